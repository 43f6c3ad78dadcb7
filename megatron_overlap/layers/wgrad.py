"""Weight-gradient accumulation into `main_grad` (Megatron's
gradient_accumulation_fusion): apex's fused kernel when it is importable, a torch
addmm otherwise, with Megatron's conventions for what autograd gets back.

Split in two so a pass can be replayed from a CUDA graph: the device work
(`weight_grad`, into `grad_buffer`'s tensor or `main_grad_written`) and what autograd
gets back (`grad_for_autograd`, host only). `trains` False is a frozen weight: no grad
at all, main_grad left alone (as Megatron's frozen path)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from ..comm.transport import FLOAT8
from ..overlap.streams import off_capture

try:  # apex's CUDA extension; optional
    import fused_weight_gradient_mlp_cuda as _apex_wgrad  # type: ignore
except ImportError:  # pragma: no cover - depends on the machine
    _apex_wgrad = None

HAVE_APEX_WGRAD = _apex_wgrad is not None

GemmInto = Callable[..., torch.Tensor]  # gemm(a, b, out=None) -> a @ b


def accumulates(weight: torch.Tensor, fuse: bool) -> bool:
    """Whether dW goes into `weight.main_grad` instead of back to autograd."""
    return fuse and hasattr(weight, "main_grad")


def weight_grad(weight: torch.Tensor, grad_out: torch.Tensor, inp: torch.Tensor, fuse: bool,
                gemm: GemmInto, out: Optional[torch.Tensor] = None) -> None:
    """dW = grad_out^T @ inp, into `out`, or accumulated into weight.main_grad when
    `accumulates(weight, fuse)` (then `out` is unused). FP8 operands go to `gemm` (a
    scaled GEMM whose output dtype is main_grad's) as they are: grad_out laid out so its
    transpose is row-major, inp column-major."""
    if not accumulates(weight, fuse):
        gemm(grad_out.t(), inp, out)
        return
    main_grad = weight.main_grad
    if grad_out.dtype in FLOAT8:  # FP8 operands: the scaled GEMM outputs main_grad's dtype
        main_grad.add_(gemm(grad_out.t(), inp))
        return
    if _apex_wgrad is not None and main_grad.is_cuda:
        kernel = (_apex_wgrad.wgrad_gemm_accum_fp32 if main_grad.dtype == torch.float32
                  else _apex_wgrad.wgrad_gemm_accum_fp16)
        with off_capture():  # a cuBLAS GEMM too
            kernel(inp, grad_out, main_grad)
    else:
        main_grad.add_(gemm(grad_out.t().to(main_grad.dtype), inp.to(main_grad.dtype)))


def autograd_grad(weight: torch.Tensor, like: torch.Tensor) -> Optional[torch.Tensor]:
    """What autograd gets for a weight whose grad went into main_grad: Megatron's
    placeholder (and `grad_added_to_main_grad` set), or None."""
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(weight.main_grad.shape, dtype=like.dtype, device=like.device)


def grad_buffer(weight: torch.Tensor, like: torch.Tensor, fuse: bool,
                trains: bool = True) -> Optional[torch.Tensor]:
    """Where `weight_grad` writes dW (allocated like `like`), or None: it accumulates into
    main_grad, or the weight is frozen."""
    return None if not trains or accumulates(weight, fuse) else like.new_empty(weight.shape)


def main_grad_written(weight: torch.Tensor, fuse: bool,
                      trains: bool = True) -> Optional[torch.Tensor]:
    """The main_grad that `weight_grad` accumulates into, or None."""
    return weight.main_grad if trains and accumulates(weight, fuse) else None


def grad_for_autograd(grad_w: Optional[torch.Tensor], weight: torch.Tensor, like: torch.Tensor,
                      trains: bool = True) -> Optional[torch.Tensor]:
    """What autograd gets for the weight: `grad_w` (`grad_buffer`'s tensor), Megatron's
    main_grad placeholder (`autograd_grad`), or None for a frozen weight."""
    if not trains or grad_w is not None:
        return grad_w
    return autograd_grad(weight, like)
