"""Weight-gradient accumulation into `main_grad` (Megatron's
gradient_accumulation_fusion): apex's fused kernel when it is importable, a torch
addmm otherwise, with Megatron's conventions for what autograd gets back."""

from __future__ import annotations

import torch

try:  # apex's CUDA extension; optional
    import fused_weight_gradient_mlp_cuda as _apex_wgrad  # type: ignore
except ImportError:  # pragma: no cover - depends on the machine
    _apex_wgrad = None

HAVE_APEX_WGRAD = _apex_wgrad is not None


def weight_grad(weight: torch.Tensor, grad_out: torch.Tensor, inp: torch.Tensor,
                fuse: bool, gemm) -> torch.Tensor | None:
    """dW = grad_out^T @ inp, returned, or accumulated into weight.main_grad when
    `fuse` (then autograd gets Megatron's placeholder, or None)."""
    if not (fuse and hasattr(weight, "main_grad")):
        return gemm(grad_out.t(), inp)
    main_grad = weight.main_grad
    if _apex_wgrad is not None and main_grad.is_cuda:
        kernel = (_apex_wgrad.wgrad_gemm_accum_fp32 if main_grad.dtype == torch.float32
                  else _apex_wgrad.wgrad_gemm_accum_fp16)
        kernel(inp, grad_out, main_grad)
    else:
        main_grad.add_(gemm(grad_out.t().to(main_grad.dtype), inp.to(main_grad.dtype)))
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    weight.grad_added_to_main_grad = True
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    return make(main_grad.shape, dtype=inp.dtype, device=inp.device)
