"""Activation recompute of an FP8 model without Transformer Engine.

megatron-core checkpoints with Transformer Engine's `te_checkpoint` wherever `config.fp8`
is set (full recompute, selective 'mlp' recompute, MoE, multi-token prediction). Without
TE that name is None or a function that raises, so an FP8 model with recompute would stop
at its first step. Our FP8 linears need nothing of TE's checkpoint: current scaling takes
each scale from the tensor at hand, so a recompute finds the same scales, and the FP8
weight cache is reused. So while installed, where TE is absent, `te_checkpoint` is
Megatron's own `tensor_parallel.checkpoint`, given the same arguments but TE's two (the
RNG tracker getter: Megatron's checkpoint restores the same tracker; the TP group)."""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

# where megatron-core 0.14-0.19 looks `te_checkpoint` up: the TE extension module (imported
# inside functions by transformer_layer and multi_token_prediction), and the modules that
# import it at their top
MODULES = ("megatron.core.extensions.transformer_engine",
           "megatron.core.transformer.transformer_block",
           "megatron.core.transformer.moe.moe_layer",
           "megatron.core.recompute")
_MISSING = object()
_saved: dict[str, Any] = {}


def megatron_checkpoint(forward_func: Callable, distribute_saved_activations: bool,
                        get_rng_state_tracker: Callable, tp_group: Any, *args: Any,
                        **kwargs: Any) -> Any:
    """`te_checkpoint`'s signature, Megatron's `tensor_parallel.checkpoint` underneath
    (keyword arguments, which it does not take, bound to the function: like TE's, they
    are passed through, not checkpointed)."""
    from megatron.core import tensor_parallel

    fn = functools.partial(forward_func, **kwargs) if kwargs else forward_func
    return tensor_parallel.checkpoint(fn, distribute_saved_activations, *args)


def _te_missing() -> bool:
    try:
        te = importlib.import_module(MODULES[0])
    except ImportError:  # pragma: no cover - a megatron-core whose TE module needs TE
        return True
    return not getattr(te, "HAVE_TE", False)


def patch() -> None:
    """Point every `te_checkpoint` megatron-core looks up at `megatron_checkpoint`, where
    Transformer Engine is not installed (with TE, its own checkpoint stays)."""
    if _saved or not _te_missing():
        return
    for name in MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:  # a module this megatron-core version does not have
            continue
        _saved[name] = getattr(mod, "te_checkpoint", _MISSING)
        mod.te_checkpoint = megatron_checkpoint


def unpatch() -> None:
    for name, before in _saved.items():
        mod = importlib.import_module(name)
        if before is _MISSING:
            del mod.te_checkpoint
        else:
            mod.te_checkpoint = before
    _saved.clear()
