"""install() / uninstall(): the user-facing switch."""

from __future__ import annotations

import logging

from .. import comm
from ..config import env as envvars
from ..config import OverlapConfig, state
from ..config.names import FAST_ACCUM_DEFAULT
from ..layers import precision
from ..overlap import replay, streams
from . import attention as core_attention
from . import mlp, norms, recompute, swap

log = logging.getLogger("megatron_overlap")
_previous: list[tuple[state.State | None, tuple]] = []


def _check_knobs(graphs, gemm_streams, inter, timeout_s, fp8_scaling, fp8_fast_accum,
                 fp8_fused_activation) -> None:
    if graphs is not None and not isinstance(graphs, bool):
        raise ValueError(f"megatron_overlap.install: graphs must be True, False or None, not {graphs!r}")
    streams.check_count(gemm_streams, "megatron_overlap.install")
    if inter is not None and inter not in comm.INTER_BACKENDS:
        raise ValueError(f"megatron_overlap.install: inter_backend must be one of "
                         f"{comm.INTER_BACKENDS} or None, not {inter!r}")
    if timeout_s is not None:
        envvars.checked_timeout_s(timeout_s)
    for key, value in (("fp8_scaling", fp8_scaling), ("fp8_fast_accum", fp8_fast_accum)):
        precision.check_choice(key, value, "megatron_overlap.install")
    mlp.check(fp8_fused_activation)


def _set_knobs(knobs: tuple) -> tuple:
    """(graphs, gemm_streams, inter_backend, timeout_s, attention, fp8_scaling,
    fp8_fast_accum, fp8_fused_activation) overrides in force; returns the previous ones."""
    graphs, gemm_streams, inter, timeout_s, attention, fp8_scaling, fast, fused_act = knobs
    return (replay.set_enabled(graphs), streams.set_default_gemm_streams(gemm_streams),
            comm.set_inter_backend(inter), envvars.set_timeout_s(timeout_s),
            core_attention.set_mode(attention), precision.choose("fp8_scaling", fp8_scaling),
            precision.choose("fp8_fast_accum", fast), mlp.set_enabled(fused_act))


def install(ub_cfgs: state.Source = None, backend: str = "auto", *, graphs: bool | None = None,
            gemm_streams: int | None = None, inter_backend: str | None = None,
            timeout_s: float | None = None, attention: str = "torch",
            fp8_scaling: str = "tensorwise",
            fp8_fast_accum: str = FAST_ACCUM_DEFAULT,
            fp8_fused_activation: bool = True) -> OverlapConfig:
    """Turn the overlap on for layers built from now on: Megatron's TP linears
    built for the 'qkv' / 'proj' / 'fc1' / 'fc2' buffers of a config with
    `tp_comm_overlap=True` become overlapped, torch norms accept sequence
    parallelism, and, without Transformer Engine, an FP8 config's activation recompute
    runs Megatron's own checkpoint (megatron-core asks TE's for it: `recompute`).

    ub_cfgs: None (Transformer Engine's defaults), a path to a TE-style
    `--tp-comm-overlap-cfg` YAML, or the same as a dict. backend: "auto" or a
    transport name. Returns the effective per-layer settings. Calling it again
    replaces the settings; uninstall() restores what was there before.

    The knobs an environment variable also sets (None: the variable's value):
    graphs: capture each pass in a CUDA graph and replay it (MEGATRON_OVERLAP_GRAPHS, on);
    gemm_streams: streams for chunk GEMMs where a layer's `gemm_streams` key is 0
    (MEGATRON_OVERLAP_GEMM_STREAMS, 3 as Transformer Engine runs them); inter_backend: the
    transport between nodes of a TP group that spans them (MEGATRON_OVERLAP_INTER_BACKEND,
    torch_p2p); timeout_s: how long one wait may block before it is a diagnosed CommError,
    in seconds, > 0 and at most a week (MEGATRON_OVERLAP_TIMEOUT_S, 300; transports made before keep theirs).

    attention: the core attention of every transformer layer built while installed,
    whatever its tp_comm_overlap: "torch" (torch's fused attention,
    `attention.TorchDotProductAttention`; a config it cannot run keeps Megatron's, with
    the reason reported) or "megatron" (Megatron's DotProductAttention).

    fp8_scaling: the scales of layers whose config asks for FP8 current scaling
    (fp8_recipe="tensorwise"): "tensorwise" (one per tensor) or "rowwise" (one per row
    of each GEMM's first operand and per output column of its second; needs
    fp8_wgrad=False and bf16 parameters; docs/fp8.md).

    fp8_fast_accum: the FP8 GEMMs that accumulate fast (torch._scaled_mm's use_fast_accum:
    on Hopper the tensor cores' accumulator, not promoted to fp32 as the sum goes): "fprop"
    (the forward GEMM, as Transformer Engine's recipes and torchao's Float8Linear run it),
    "none", or "all" (the dgrad and wgrad too: faster, less exact).

    fp8_fused_activation: an FP8 MLP's SwiGLU writes fc2's FP8 input and, in the backward,
    fc1's FP8 output gradient itself, in one kernel each (Transformer Engine's activations
    write FP8 too), where the linears otherwise read its bf16 output again to cast it
    (`megatron.mlp`); False keeps Megatron's SwiGLU."""
    envvars.check_all()  # a bad MEGATRON_OVERLAP_* value fails here, naming it
    if backend != "auto":
        comm.resolve_backend(backend)  # fail now, not at the first forward
    _check_knobs(graphs, gemm_streams, inter_backend, timeout_s, fp8_scaling, fp8_fast_accum,
                 fp8_fused_activation)
    core_attention.check(attention)
    new = state.make(ub_cfgs, backend)
    previous_knobs = _set_knobs((graphs, gemm_streams, inter_backend, timeout_s, attention,
                                 fp8_scaling, fp8_fast_accum, fp8_fused_activation))
    if not _previous:
        swap.patch()
        mlp.patch()
        norms.patch()
        core_attention.patch()
        recompute.patch()
    _previous.append((state.set_state(new), previous_knobs))
    if log.isEnabledFor(logging.INFO):
        # per-peer transports: the table shows what the inter-node link honours
        shown = comm.resolve_backend(backend)
        shown = comm.inter_backend() if shown in comm.COMPOSITE else shown
        log.info("megatron_overlap installed (backend=%s, core attention: %s)\n%s", backend, attention,
                 new.settings.table(shown))
    return new.settings


def uninstall() -> None:
    """Restore the state before the matching install(); a no-op when not installed."""
    if not _previous:
        return
    old, knobs = _previous.pop()
    state.set_state(old)
    _set_knobs(knobs)
    if not _previous:
        swap.unpatch()
        mlp.unpatch()
        norms.unpatch()
        core_attention.unpatch()
        recompute.unpatch()
        comm.reset()
