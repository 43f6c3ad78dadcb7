"""The SwiGLU between an FP8 fc1 and fc2, fused with their casts (`overlap.fp8_act`): its
forward writes fc2's FP8 input as fc2's forward pass would have cast it (the layout its
schedule reads, the transposed copy its wgrad reads, the scale of its recipe), its backward
writes fc1's FP8 output gradient as fc1's backward would have (both layouts). Between the
linears these travel as an `Fp8Activation`: autograd sees a tensor of the activation's
dtype and shape; our linears read its FP8 parts; anything else that reads it gets its
values dequantized (`__torch_dispatch__`), never the FP8 bytes as numbers.

Used by `megatron.mlp.OverlapMLP` where Megatron's MLP runs a SwiGLU between two of our FP8
linears with per-tensor scales (tensorwise or delayed) and FP8 wgrads; elsewhere the
SwiGLU stays Megatron's.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch.utils._pytree import tree_map

from ..overlap import fp8_act
from ..overlap.fp8 import chunk_major, scale_pair, scale_value


class Fp8Activation(torch.Tensor):
    """An activation already quantized for the linear that reads it: `fp8` (2-D [tokens,
    width], rows chunk-major by `chunks` where fc2's schedule reads them so), `fp8_t` (the
    same values transposed, or None), `scale` (its scale pair), `amax` (delayed scaling:
    what the pass records, else None). Its shape and dtype are the activation's."""

    fp8: torch.Tensor
    fp8_t: Optional[torch.Tensor]
    scale: torch.Tensor
    amax: Optional[torch.Tensor]
    chunks: Optional[tuple[int, int]]

    @staticmethod
    def __new__(cls, fp8: torch.Tensor, fp8_t: Optional[torch.Tensor], scale: torch.Tensor,
                amax: Optional[torch.Tensor], chunks: Optional[tuple[int, int]],
                shape: torch.Size, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=fp8.device)

    def __init__(self, fp8: torch.Tensor, fp8_t: Optional[torch.Tensor], scale: torch.Tensor,
                 amax: Optional[torch.Tensor], chunks: Optional[tuple[int, int]],
                 shape: torch.Size, dtype: torch.dtype):
        self.fp8, self.fp8_t, self.scale, self.amax, self.chunks = fp8, fp8_t, scale, amax, chunks

    def dequantized(self) -> torch.Tensor:
        """The values in the activation's dtype and shape, rows in token order."""
        rows = self.fp8 if self.chunks is None else chunk_major(self.fp8, self.chunks[1],
                                                                 self.chunks[0])
        return (rows.to(torch.float32) / scale_value(self.scale)).to(self.dtype).view(self.shape)

    def __repr__(self) -> str:  # (the default would print through __torch_dispatch__)
        return (f"Fp8Activation(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"fp8={self.fp8.dtype}, chunks={self.chunks})")

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def plain(t: Any) -> Any:
            return t.dequantized() if isinstance(t, Fp8Activation) else t
        return func(*tree_map(plain, args), **tree_map(plain, kwargs or {}))


def input_for(fc2: Any, y: torch.Tensor, grad_mode: bool) -> Fp8Activation:
    """fc2's FP8 input, swiglu(y), as fc2's forward pass would cast it (`Fp8Forward`): the
    rows in its schedule's order (`row_input_order`), transposed too where its FP8 wgrad
    will read it, its scale from its recipe (delayed: fc2's input history; the amax pair
    its pass records, the weight's place filled by the pass)."""
    from . import checks
    from .functions import row_input_order  # (functions reads Fp8Activation)

    width = y.shape[-1] // 2
    # fc2's refusals first (its splits, its token count), naming it, as its forward would:
    # on a stand-in of the activation's shape that holds no memory
    checks.check_row(fc2, y.new_empty(()).expand(*y.shape[:-1], width))
    p, plan, tp = fc2.precision, fc2.overlap_plan, fc2.transport
    rows = y.numel() // y.shape[-1]
    chunks = row_input_order(plan, tp, fc2._layouts.get("fprop"), p.recipe)
    want_t = p.wgrad and fc2.weight.requires_grad and grad_mode
    out = torch.empty((rows, width), dtype=p.fwd, device=y.device)
    out_t = torch.empty((width, rows), dtype=p.fwd, device=y.device) if want_t else None
    pair, delayed = scale_pair(y.device), fc2._fp8_delayed
    amax = None if delayed is None else torch.empty(2, dtype=torch.float32, device=y.device)
    fp8_act.quantized("swiglu", y, None, p.fwd, pair, out, out_t, chunks,
                      None if delayed is None else delayed.get("input", y.device),
                      None if amax is None else amax[0])
    return Fp8Activation(out, out_t, pair, amax, chunks, (*y.shape[:-1], width), y.dtype)


def grad_for(fc1: Any, g: torch.Tensor, y: torch.Tensor) -> Fp8Activation:
    """fc1's FP8 output gradient, swiglu_grad(g, y), as fc1's backward would cast it
    (`Fp8Backward.grad`: its own amax, not gathered), transposed too where its FP8 wgrad
    reads it."""
    p, delayed = fc1.precision, fc1._fp8_delayed
    rows, width = y.numel() // y.shape[-1], y.shape[-1]
    col = p.wgrad and fc1.weight.requires_grad
    out = torch.empty((rows, width), dtype=p.grad, device=y.device)
    out_t = torch.empty((width, rows), dtype=p.grad, device=y.device) if col else None
    pair = scale_pair(y.device)
    amax = None if delayed is None else torch.empty((), dtype=torch.float32, device=y.device)
    fp8_act.quantized("swiglu_grad", y, g, p.grad, pair, out, out_t, None,
                      None if delayed is None else delayed.get("grad", y.device), amax)
    return Fp8Activation(out, out_t, pair, amax, None, y.shape, y.dtype)


class SwiGLUFp8(torch.autograd.Function):
    """swiglu(y) as fc2's FP8 input; its backward fc1's FP8 output gradient."""

    @staticmethod
    def forward(ctx, y: torch.Tensor, fc1: Any, fc2: Any, grad_mode: bool):
        ctx.fc1 = fc1
        ctx.save_for_backward(y)
        return input_for(fc2, y, grad_mode)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        (y,) = ctx.saved_tensors
        if isinstance(g, Fp8Activation):  # (never from our fc2: it returns its dgrad in bf16)
            g = g.dequantized()
        return grad_for(ctx.fc1, g, y), None, None, None
