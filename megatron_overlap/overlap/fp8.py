"""FP8 at the GEMM seam: tensors quantized with per-tensor scales (current scaling,
Transformer Engine's and Megatron's 'tensorwise' recipe) and the scaled GEMM that
multiplies them, which a schedule takes as its `gemm`: the schedules stay one.

- Scaling and casting are torchao's float8 (`amax_to_scale`, `to_fp8_saturated`; the
  [fp8] extra), imported when FP8 first runs, so the runtime imports without it. A scale
  is torchao's: fp8 = saturate(x * scale), x ~ fp8 / scale. On a GPU the cast runs as one
  fused kernel (`_fused_cast`), the amax as one reduction.
- Own code, and why:
  - `ScaledGemm` calls `torch._scaled_mm` itself: the schedules write every chunk's
    product into its place of the pass's output (`out=`, the addresses a CUDA-graph
    replay keeps), which torchao's `addmm_float8_unwrapped` does not offer; and it checks
    cuBLAS's layout rules on every device (CPU runs any layout, the GPU does not), so a
    CPU test catches an operand a GPU would refuse.
  - `shared_amax`: the amax of a tensor that will be gathered is the maximum over the TP
    group (as TE's current scaling reduces it), so the gathered tensor has one scale and
    equals one whole-tensor quantization. The reduction is an all-gather of one float per
    rank through the transport (bounded, named, traced like every wait here); torchao's
    `reduce_amax` is an unbounded functional collective over a device mesh.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional

import torch

from ..comm import trace
from ..comm.transport import FLOAT8, Transport


def _ao():
    from ..extras import require

    return require("torchao.float8.float8_utils", "FP8 in the overlapped linears")


def available() -> None:
    """Raise MissingExtra (naming the [fp8] extra) when torchao cannot be imported."""
    _ao()


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a float32 scalar: torchao's tensorwise amax (max of abs, exact), read in
    one pass (`tensor_to_amax` writes |x| first: three times the memory traffic)."""
    return torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)


def shared_amax(x: torch.Tensor, tp: Transport, op: str) -> torch.Tensor:
    """max |x| over every rank of `tp`: the amax of the tensor a gather of `x` makes.
    Collective over the TP group, inside the caller's transport pass."""
    local = amax(x).reshape(1)
    if tp.world_size == 1:
        return local[0]
    every = local.new_empty(tp.world_size)
    tp.all_gather(every, local, op=op).wait()
    return every.max()


def scale_for(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The scale that maps amax `a` to `dtype`'s largest value (torchao's rounding)."""
    return _ao().amax_to_scale(a, dtype)


def _cast_by(saturate, x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The one definition of the numbers: out = saturate(fp32(x) * scale) (torchao's)."""
    return out.copy_(saturate(x.to(torch.float32) * scale, out.dtype))


def _cast(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return _cast_by(_ao().to_fp8_saturated, x, scale, out)


_fused: dict = {}  # (input dtype, FP8 dtype) -> the compiled cast; None: eager from now on
log = logging.getLogger("megatron_overlap")


def _fused_cast(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> Optional[torch.Tensor]:
    """`_cast` as one kernel on a GPU, or None where it does not run so: eagerly the cast is
    four passes over fp32 temporaries (upcast, multiply, clamp, cast: ~27 bytes of memory
    traffic per element where 3 are needed), which cost an FP8 layer more than its GEMMs
    save. torch.compile (inductor) fuses the same ops, elementwise in fp32, rounding to
    nearest even as eager does: the same bits (tests/gpu/test_fp8_cast_gpu.py). One
    compiled function per dtype pair, on flat tensors of any length, so that a model's
    shapes compile once; a failure is logged once and the casts run eagerly."""
    if x.device.type != "cuda" or not (x.is_contiguous() and out.is_contiguous()):
        return None
    key = (x.dtype, out.dtype)
    if key not in _fused:
        _fused[key] = torch.compile(functools.partial(_cast_by, _ao().to_fp8_saturated),
                                    dynamic=True)
    fn = _fused[key]
    if fn is None:
        return None
    try:
        fn(x.view(-1), scale, out.view(-1))
    except Exception as exc:  # noqa: BLE001  (no inductor / triton here: eager, slower, same bits)
        _fused[key] = None
        log.warning("megatron_overlap: FP8 casts from %s run eagerly (4 memory passes each): "
                    "torch.compile failed (%s: %s)", x.dtype, type(exc).__name__, exc)
        return None
    return out


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """saturate(x * scale) in `dtype` (x upcast to fp32 first), into `out` when given."""
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    elif out.dtype != dtype:
        raise TypeError(f"quantize: out is {out.dtype}, not {dtype}")
    fused = _fused_cast(x, scale, out)
    return fused if fused is not None else _cast(x, scale, out)


def _check(a: torch.Tensor, b: torch.Tensor, op: str) -> None:
    """cuBLAS's FP8 rules (torch._scaled_mm on a GPU): FP8 operands, not both e5m2; the
    first row-major, the second column-major; K and N multiples of 16."""
    if a.dtype not in FLOAT8 or b.dtype not in FLOAT8:
        raise TypeError(f"{op}: an FP8 GEMM got {a.dtype} x {b.dtype}")
    if a.dtype == b.dtype == torch.float8_e5m2:
        raise TypeError(f"{op}: an FP8 GEMM of two e5m2 operands (cuBLAS refuses it)")
    if a.stride(-1) != 1 or b.stride(-2) != 1:
        raise ValueError(f"{op}: FP8 GEMM operands must be row-major x column-major, got "
                         f"strides {a.stride()} x {b.stride()}")
    if a.shape[-1] % 16 or b.shape[-1] % 16:
        raise ValueError(f"{op}: FP8 GEMM of {tuple(a.shape)} x {tuple(b.shape)}: K and N must "
                         f"be multiples of 16")


class ScaledGemm:
    """`a @ b` of FP8 operands quantized with the per-tensor scales `a_scale`, `b_scale`
    (torchao's meaning), through torch._scaled_mm: the schedules' `gemm` for an FP8
    pass. The product is `out`'s dtype, or `out_dtype` (bf16 or fp32), never FP8."""

    def __init__(self, a_scale: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype):
        self.a_inv, self.b_inv = a_scale.reciprocal(), b_scale.reciprocal()
        self.out_dtype = out_dtype

    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                 op: str, chunk: int = 0) -> torch.Tensor:
        trace.record("gemm", op, chunk)
        _check(a, b, op)
        dtype = out.dtype if out is not None else self.out_dtype
        if a.dim() == 3:  # _scaled_mm has no batched form: one GEMM per batch entry
            if out is None:
                out = a.new_empty(a.shape[0], a.shape[1], b.shape[-1], dtype=dtype)
            for i in range(a.shape[0]):
                torch._scaled_mm(a[i], b[i], scale_a=self.a_inv, scale_b=self.b_inv,
                                 out_dtype=dtype, out=out[i])
            return out
        if out is None:
            return torch._scaled_mm(a, b, scale_a=self.a_inv, scale_b=self.b_inv, out_dtype=dtype)
        return torch._scaled_mm(a, b, scale_a=self.a_inv, scale_b=self.b_inv, out_dtype=dtype,
                                out=out)
