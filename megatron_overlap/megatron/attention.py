"""The core-attention swap: while installed with attention="torch" (the default), building
Megatron's DotProductAttention builds `attention.TorchDotProductAttention` instead, in every
spec (the local spec, a user's own, one built before install()), as the linears' swap does
(`swap`): the class's `__init__` is hooked, the instance becomes the subclass before
anything is built. With attention="megatron" Megatron's class is built, marked with that
reason for the report. Independent of `tp_comm_overlap`: both arms of an A/B run get the
same attention, so the A/B measures the overlap alone."""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.dot_product_attention import DotProductAttention

CHOICES = ("torch", "megatron")
KEPT = "install(attention='megatron') keeps Megatron's attention"
_state: dict[str, Any] = {"original": None, "mode": "torch"}


def check(attention: str) -> str:
    if attention not in CHOICES:
        raise ValueError(f"megatron_overlap.install: attention must be one of {CHOICES} (torch: torch's "
                         f"fused attention; megatron: Megatron's DotProductAttention), not {attention!r}")
    return attention


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    from ..attention import TorchDotProductAttention

    if type(self) is DotProductAttention and _state["mode"] == "torch":
        self.__class__ = TorchDotProductAttention
        TorchDotProductAttention.__init__(self, *args, **kwargs)
        return
    _state["original"](self, *args, **kwargs)
    if type(self) is DotProductAttention:
        self.megatron_overlap_attention = KEPT


def set_mode(attention: str) -> str:
    """Which attention layers built from now on get; returns the previous choice."""
    previous, _state["mode"] = _state["mode"], check(attention)
    return previous


def patch() -> None:
    if _state["original"] is None:
        _state["original"] = DotProductAttention.__dict__["__init__"]
        _init.__wrapped__ = _state["original"]
        DotProductAttention.__init__ = _init


def unpatch() -> None:
    if _state["original"] is not None:
        DotProductAttention.__init__ = _state["original"]
        _state["original"] = None
