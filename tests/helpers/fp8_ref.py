"""The FP8 reference of the tests, written independently of the schedules, the layers
and torchao: a tensor is quantized whole, with plain torch ops (per-tensor current
scaling: scale = fp8 max / amax, rounded from float64 to float32; the value scaled in
fp32, saturated, cast; row-wise: the same per row, or per column, with the scale rounded
down to a power of two), and a product is one whole-tensor `torch._scaled_mm`. Nothing
here gathers, chunks or reduces: a test builds the whole tensor every rank's shard
comes from, and sums the ranks' partial products itself."""

from __future__ import annotations

import torch

from megatron_overlap.ab.compare import rel_error

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def scale(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    amax = t.detach().abs().max().to(torch.float64)
    return (torch.finfo(dtype).max / amax.clamp(min=1e-12)).to(torch.float32)


def quantize(t: torch.Tensor, dtype: torch.dtype, s: torch.Tensor | None = None):
    """(t in `dtype`, its scale); `s` given: with that scale (a shard of a tensor whose
    scale is the whole tensor's)."""
    s = scale(t, dtype) if s is None else s
    m = torch.finfo(dtype).max
    return (t.detach().to(torch.float32) * s).clamp(-m, m).to(dtype), s


def axis_scale(t: torch.Tensor, dtype: torch.dtype, dim: int) -> torch.Tensor:
    """One scale per slice along `dim` (dim=1: per row, [m, 1]; dim=0: per column,
    [1, n]): fp8 max / amax, in float64, to float32, rounded down to a power of two."""
    amax = t.detach().abs().to(torch.float64).amax(dim=dim, keepdim=True)
    s = (torch.finfo(dtype).max / amax.clamp(min=1e-12)).to(torch.float32)
    _, e = torch.frexp(s)  # s = m * 2^e, m in [0.5, 1): the power of two below is 2^(e-1)
    return torch.ldexp(torch.ones_like(s), e - 1)


def quantize_axis(t: torch.Tensor, dtype: torch.dtype, dim: int):
    """(t in `dtype`, its scales): per row (dim=1) or per column (dim=0)."""
    return quantize(t, dtype, axis_scale(t, dtype, dim))


def mm(a8: torch.Tensor, sa: torch.Tensor, b8: torch.Tensor, sb: torch.Tensor,
       out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b of two quantized tensors (any layout; made row-major x column-major here)."""
    return torch._scaled_mm(a8.contiguous(), b8.t().contiguous().t(), scale_a=sa.reciprocal(),
                            scale_b=sb.reciprocal(), out_dtype=out_dtype)


def summed(parts_in: list, parts_w: list, rank: int, rows: int, scatter: bool,
           dtype: torch.dtype) -> torch.Tensor:
    """What rank `rank` must hold after an FP8 GEMM -> reduce-scatter (or all-reduce,
    `scatter` False): every rank's partial product (its input and weight each quantized
    whole, in e4m3) summed in float64, then its block of `rows` rows."""
    partials = []
    for x, w in zip(parts_in, parts_w):
        a8, sa = quantize(x, E4M3)
        b8, sb = quantize(w, E4M3)
        partials.append(mm(a8, sa, b8.t(), sb, dtype).double())
    total = sum(partials)
    return total[rank * rows:(rank + 1) * rows] if scatter else total


def dequantize(t8: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (t8.to(torch.float32) / s).to(dtype)


rel = rel_error
