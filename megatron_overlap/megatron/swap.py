"""The swap at model construction: while installed, building Megatron's
ColumnParallelLinear / RowParallelLinear for a TP-comm buffer ('qkv', 'proj',
'fc1', 'fc2') with `config.tp_comm_overlap=True` builds our subclass instead.

It hooks the classes' `__init__` (the instance becomes the subclass before
anything is built), not the specs, so it holds whichever spec the
model comes from (the local spec, a spec built before install(), a user's own),
and however megatron-core 0.14-0.19 instantiates submodules (build_module or a
direct call). Megatron's own output layer, MoE experts and any layer without one
of those buffer names are left alone. Also `overlap_layer_spec(spec)`, for users
who prefer to put the classes into their spec explicitly.

`TransformerLayer.__init__` is wrapped too, so that a linear built inside knows its
layer's number (`layers.precision.building`): Megatron keeps some layers in bf16 by
number (first_last_layers_bf16), and a linear is given no number of its own."""

from __future__ import annotations

import copy
import functools
import logging
from typing import Any

from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.transformer_layer import TransformerLayer

from ..config import COLUMN_BUFFERS, ROW_BUFFERS
from ..config.console import say_once
from ..layers.precision import building

# the local spec's submodule of each buffer: linear_qkv, linear_fc1 (column), linear_proj, linear_fc2
_SLOTS = {f"linear_{b}": kind for kind, bs in (("column", COLUMN_BUFFERS), ("row", ROW_BUFFERS))
          for b in bs}


def _targets():
    from ..layers import OverlapColumnParallelLinear, OverlapRowParallelLinear

    return {ColumnParallelLinear: (OverlapColumnParallelLinear, COLUMN_BUFFERS),
            RowParallelLinear: (OverlapRowParallelLinear, ROW_BUFFERS)}


def wants_overlap(kwargs: dict[str, Any], buffers: tuple[str, ...]) -> bool:
    config = kwargs.get("config")
    return (bool(getattr(config, "tp_comm_overlap", False))
            and kwargs.get("tp_comm_buffer_name") in buffers and not kwargs.get("is_expert", False))


_original_init: dict[type, Any] = {}


def report_not_fp8(kind: str, kwargs: dict[str, Any]) -> None:
    """An FP8 config on a linear that stays Megatron's: without Transformer Engine,
    megatron-core runs it in the parameters' dtype and says nothing; we say it (once per
    kind of linear and reason), naming what would make it FP8 where something would."""
    config = kwargs.get("config")
    if not getattr(config, "fp8", None):
        return
    name = kwargs.get("tp_comm_buffer_name") or "unnamed"
    if kwargs.get("is_expert", False):
        why = "an MoE expert's linear, which megatron_overlap does not overlap"
    elif not getattr(config, "tp_comm_overlap", False):
        why = "tp_comm_overlap=False: set tp_comm_overlap=True for megatron_overlap's FP8 linears"
    else:
        why = "not one of the linears megatron_overlap overlaps (the output layer, ...)"
    say_once(logging.WARNING,
             f"megatron_overlap: {kind} '{name}' is Megatron's own and runs in "
             f"{getattr(config, 'params_dtype', 'its parameters dtype')}, not fp8="
             f"{config.fp8!r} (no Transformer Engine): {why}")


def _swapping_init(base: type):
    original = base.__dict__["__init__"]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        target = _targets()[base]
        if type(self) is base and wants_overlap(kwargs, target[1]):
            # Become the subclass before anything is built, then build as it.
            self.__class__ = target[0]
            target[0].__init__(self, *args, **kwargs)
        else:
            if type(self) is base:
                report_not_fp8(base.__name__, kwargs)
            original(self, *args, **kwargs)

    __init__.__wrapped__ = original
    return __init__


def _numbering_init(original):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        with building(self):  # its layer_number is set before its submodules are built
            original(self, *args, **kwargs)

    __init__.__wrapped__ = original
    return __init__


def patch() -> None:
    for cls in (ColumnParallelLinear, RowParallelLinear):
        if cls not in _original_init:
            _original_init[cls] = cls.__dict__["__init__"]
            cls.__init__ = _swapping_init(cls)
    if TransformerLayer not in _original_init:
        _original_init[TransformerLayer] = TransformerLayer.__dict__["__init__"]
        TransformerLayer.__init__ = _numbering_init(_original_init[TransformerLayer])


def unpatch() -> None:
    for cls, init in _original_init.items():
        cls.__init__ = init
    _original_init.clear()


def overlap_layer_spec(spec: Any, attention: str = "torch") -> Any:
    """A copy of a transformer-layer (or block) ModuleSpec whose linear_qkv /
    linear_proj / linear_fc1 / linear_fc2 are our layers wherever they were
    Megatron's ColumnParallelLinear / RowParallelLinear, and whose core_attention is
    `attention.TorchDotProductAttention` where it was Megatron's DotProductAttention
    (attention="torch", as install() does; "megatron" leaves it)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from ..attention import TorchDotProductAttention
    from ..layers import OverlapColumnParallelLinear, OverlapRowParallelLinear
    from .attention import check

    slots = dict(_SLOTS)
    ours = {ColumnParallelLinear: OverlapColumnParallelLinear, RowParallelLinear: OverlapRowParallelLinear}
    if check(attention) == "torch":
        slots["core_attention"] = "attention"
        ours[DotProductAttention] = TorchDotProductAttention

    def walk(node: Any) -> Any:
        if isinstance(node, (list, tuple)):
            return type(node)(walk(n) for n in node)
        if isinstance(node, functools.partial) and "submodules" in node.keywords:
            # megatron-core 0.18+: MLP specs are partial(MLP.as_mlp_submodule, submodules=...)
            return functools.partial(node.func, *node.args, **{
                **node.keywords, "submodules": walk_submodules(node.keywords["submodules"])})
        sub = getattr(node, "submodules", None)
        if sub is not None and hasattr(node, "module"):
            node = copy.copy(node)
            node.submodules = walk_submodules(sub)
        return node

    def walk_submodules(sub: Any) -> Any:
        if not hasattr(sub, "__dict__"):
            return sub
        sub = copy.copy(sub)
        for field, value in vars(sub).items():
            if field in slots and value in ours:
                setattr(sub, field, ours[value])
            elif field in slots and getattr(value, "module", None) in ours:
                setattr(sub, field, copy.copy(value))
                getattr(sub, field).module = ours[value.module]
            else:
                setattr(sub, field, walk(value))
        return sub

    return walk(spec)
