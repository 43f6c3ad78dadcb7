"""Sequence parallelism with torch norms. Megatron's local spec uses
`WrappedTorchNorm` when apex is absent, and it refuses sequence parallelism
("sequence parallel not supported by torch LayerNorm"). A per-token norm is
exact on a sequence shard; what SP needs is that the norm's parameter grads,
computed on different tokens on each TP rank, get summed across the TP group:
Megatron's `finalize_model_grads` does that for parameters marked
`sequence_parallel`. While installed, WrappedTorchNorm builds the same torch
norm under SP and marks its parameters. With apex present, Megatron's specs use
apex's FusedLayerNorm, which handles SP itself, and this is never reached."""

from __future__ import annotations

from megatron.core.transformer import torch_norm

_original_new = None  # the class-dict entry as Megatron defined it (a staticmethod)


def _sp_new(cls, config, *args, **kwargs):
    sp = bool(getattr(config, "sequence_parallel", False))
    config.sequence_parallel = False  # only to pass Megatron's assertion; restored below
    try:
        norm = _original_new.__func__(cls, config, *args, **kwargs)
    finally:
        config.sequence_parallel = sp
    for p in norm.parameters():
        setattr(p, "sequence_parallel", sp)
    return norm


def patch() -> None:
    global _original_new
    if _original_new is None:
        _original_new = torch_norm.WrappedTorchNorm.__dict__["__new__"]
        torch_norm.WrappedTorchNorm.__new__ = staticmethod(_sp_new)


def unpatch() -> None:
    global _original_new
    if _original_new is not None:
        torch_norm.WrappedTorchNorm.__new__ = _original_new
        _original_new = None
