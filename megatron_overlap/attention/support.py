"""What TorchDotProductAttention cannot run: the layer then keeps Megatron's
DotProductAttention, and the reason is reported (settings table, log, wandb). Decided at
construction from the config alone, so a model never fails at its first step for it."""

from __future__ import annotations

from typing import Any, Optional

# attention_backend values that ask for Megatron's own unfused attention by name
MEGATRON_BACKENDS = ("unfused", "local")


def _backend_name(config: Any) -> str:
    backend = getattr(config, "attention_backend", None)
    return getattr(backend, "name", str(backend or "auto"))


def unsupported(config: Any) -> Optional[str]:
    """Why this config's core attention must stay Megatron's, or None."""
    if getattr(config, "context_parallel_size", 1) > 1:
        return (f"context parallelism (context_parallel_size={config.context_parallel_size}) "
                "needs ring attention across the CP group")
    softmax = getattr(config, "softmax_type", "vanilla")
    if softmax != "vanilla":
        return f"softmax_type={softmax!r} (a softmax offset / attention sinks) is not in torch's kernels"
    for flag in ("qk_clip", "log_max_attention_logit"):
        if getattr(config, flag, False):
            return f"{flag} needs the attention logits' maxima, which fused kernels do not return"
    backend = _backend_name(config)
    if backend in MEGATRON_BACKENDS:
        return f"attention_backend={backend} asks for Megatron's unfused attention"
    return None


def check_megatron_runs(config: Any, k_channels: Any, v_channels: Any, layer_number: int, why: str) -> None:
    """Before keeping Megatron's class for `why`: refuse, naming the layer, what Megatron's
    DotProductAttention cannot build or run either (it asserts context parallelism away; it
    has no slot for MLA's key / value head dims, and would fail at the first forward)."""
    cp = getattr(config, "context_parallel_size", 1) > 1
    if cp or k_channels is not None or v_channels is not None:
        cannot = ("it asserts context_parallel_size == 1" if cp else
                  "it takes no k_channels / v_channels (multi-latent attention)")
        raise ValueError(f"core attention of layer {max(1, layer_number)}: {why}; Megatron's "
                         f"DotProductAttention cannot run this layer either ({cannot}): use "
                         "Transformer Engine's spec (TEDotProductAttention) for it")


def notes(config: Any, window: Optional[tuple]) -> list[str]:
    """Where torch's attention reads a setting otherwise than Megatron's unfused path, said
    in the report and logged once: the attention backend's TE names, a negative window bound,
    a softmax Megatron would run in half precision, FP8 attention."""
    out = []
    backend = _backend_name(config)
    if backend != "auto":
        out.append(f"attention_backend={backend}: torch chooses among its fused kernels")
    if window is not None and min(window) < 0:
        out.append(f"window_size={tuple(window)}: a negative bound is unbounded here (Transformer "
                   "Engine's meaning and the config's); Megatron's unfused mask reads it literally")
    if (getattr(config, "fp16", False) or getattr(config, "bf16", False)) and \
            not getattr(config, "attention_softmax_in_fp32", True):
        out.append("attention_softmax_in_fp32=False: the fused kernels keep the softmax in fp32 "
                   "(Megatron's unfused path would run it in half precision)")
    if getattr(config, "fp8_dot_product_attention", False) or getattr(config, "fp8_multi_head_attention", False):
        out.append("fp8_dot_product_attention is not honoured: attention runs in the inputs' dtype "
                   "(Megatron's DotProductAttention does the same)")
    return out
