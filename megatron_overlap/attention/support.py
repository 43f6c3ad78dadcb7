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


def backend_note(config: Any) -> str:
    """How Megatron's `attention_backend` reads here: auto, flash and fused (Transformer
    Engine's names) all mean torch's fused kernels, torch choosing one per call."""
    backend = _backend_name(config)
    return "" if backend == "auto" else f"attention_backend={backend}: torch chooses among its fused kernels"
