"""Hand-written Triton kernels for FP8's casts and transposed copies on a GPU, where the
compiled ones (`overlap.fp8._run_compiled`) move more bytes than they need:

- `cast_transpose`: the cast writing both layouts an FP8 GEMM needs (Transformer Engine's
  cast-transpose), reading the wide tensor once. Inductor compiles that function to two
  kernels each reading it, so the layers cast and then transposed the FP8 values.
- `delayed_cast_amax` (`_t`: with the transposed copy): delayed scaling's cast with the
  history's scale, which also reduces the tensor's amax (max |x|, atomically per tile,
  into a scalar zeroed before; a NaN anywhere makes it NaN, as torch's amax) and copies
  the scale used: the amax needs no pass of its own.
- `transpose`: 1-byte values transposed. Inductor's kernel moved them at ~1.3 TB/s on an
  H100 (its fp8 layers' transposes), this one at ~2.9 TB/s.

Each computes what `overlap.fp8`'s eager definition computes, bit for bit (the cast:
fp32 multiply, clamp with NaN kept, round to nearest even; checked on the GPU:
tests/gpu/test_fp8_cast_gpu.py). Measured one by one against the compiled kernels:
`benchmarks/probe_fp8_transpose.py`. Triton is imported at the first call (the runtime
imports without it; on CPU these never run).
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

log = logging.getLogger("megatron_overlap")

KERNELS = ("cast_transpose", "delayed_cast_amax", "delayed_cast_amax_t", "transpose")
BLOCK = (64, 128, 4)  # rows, columns, warps of a tile: the probe's best over a layer's tensors
_kernel = None  # the Triton kernel, made at the first call
_seen: set = set()  # launch signatures compiled so far (a capture never compiles)
_broken: set = set()  # names that failed once: not tried again (the caller's path runs)


def _make():
    import triton
    import triton.language as tl

    @triton.jit
    def max_nan(a, b):
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit  # (m, n specialized as Triton does: 16-divisible rows vectorize its accesses)
    def cast_t(x_ptr, s_ptr, o_ptr, ot_ptr, used_ptr, amax_ptr, m, n, FMAX: tl.constexpr,
               CAST: tl.constexpr, WRITE_O: tl.constexpr, WRITE_T: tl.constexpr,
               AMAX: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
        """One [BM, BN] tile of x [m, n]: with CAST, saturate(fp32(x) * scale) into o
        (WRITE_O) and transposed into ot (WRITE_T), with AMAX max |x| into amax and the
        scale into used; without, x's bytes transposed into ot."""
        pm, pn = tl.program_id(0), tl.program_id(1)
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        mask = (rm[:, None] < m) & (rn[None, :] < n)
        offs = rm[:, None].to(tl.int64) * n + rn[None, :]
        if CAST:
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            s = tl.load(s_ptr)
            y = tl.maximum(x * s, -FMAX, propagate_nan=tl.PropagateNan.ALL)
            q = tl.minimum(y, FMAX, propagate_nan=tl.PropagateNan.ALL).to(o_ptr.dtype.element_ty)
            if WRITE_O:
                tl.store(o_ptr + offs, q, mask=mask)
            if AMAX:  # |x| >= 0 (a NaN's sign cleared too) orders as its bits: an integer
                # max, under which a NaN (above inf) wins, as in torch's amax
                top = tl.reduce(tl.abs(x), None, max_nan)
                tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), top.to(tl.int32, bitcast=True))
                if (pm == 0) & (pn == 0):
                    tl.store(used_ptr, s)
        else:
            q = tl.load(x_ptr + offs, mask=mask)
        if WRITE_T:
            offs_t = rn[:, None].to(tl.int64) * m + rm[None, :]
            tl.store(ot_ptr + offs_t, tl.trans(q), mask=tl.trans(mask))

    return cast_t


def _flat2d(t: torch.Tensor) -> Optional[torch.Tensor]:
    """`t` as a contiguous 2-D view ([rows, last dim]), or None."""
    if not t.is_contiguous() or t.dim() == 0:
        return None
    return t.view(-1, t.shape[-1]) if t.dim() != 2 else t


MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis (the tiles across the columns)


def _launch_args(name: str, args: tuple) -> Optional[tuple]:
    """(x, scale, o, ot, used, amax, flags) for the kernel, or None where it does not run
    these tensors: a layout or shape it does not take (each output exactly the input's
    shape, or its transpose's), a scale per row, scalars not float32, no elements, more
    column tiles than a grid holds."""
    if name == "transpose":
        x, ot = args
        if (x.dim() != 2 or not (x.is_contiguous() and ot.is_contiguous())
                or ot.shape != x.shape[::-1]):
            return None
        flags = dict(CAST=False, WRITE_O=False, WRITE_T=True, AMAX=False)
        x2, launch = x, (x, x, x, ot, x, x, flags)
    else:
        if name == "cast_transpose":
            x, scale, o, ot = args
            used = amax = None
        elif name == "delayed_cast_amax":
            (x, scale, used, amax, o), ot = args, None
        else:
            x, scale, used, amax, o, ot = args
        x2, o2 = _flat2d(x), _flat2d(o)
        scalars = [t for t in (scale, used, amax) if t is not None]
        if (x2 is None or o2 is None or o2.shape != x2.shape or scale.numel() != 1
                or any(t.dtype != torch.float32 or t.numel() != 1 for t in scalars)):
            return None
        if ot is not None and (x.dim() != 2 or not ot.is_contiguous() or ot.shape != x.shape[::-1]):
            return None
        scale = scale.reshape(())
        launch = (x2, scale, o2, ot if ot is not None else o2, used if used is not None else scale,
                  amax if amax is not None else scale,
                  dict(CAST=True, WRITE_O=True, WRITE_T=ot is not None, AMAX=amax is not None))
    if x2.numel() == 0 or -(-x2.shape[1] // BLOCK[1]) > MAX_GRID_Y:
        return None
    return launch


def run(name: str, args: tuple, capturing: bool) -> bool:
    """Kernel `name` on `args` (the layout of its eager definition in overlap.fp8); False
    where it does not run: Triton missing, tensors it does not take, a failure before
    (logged once), or, inside a CUDA-graph capture, a launch signature not compiled yet
    (a compile there could break the capture: the caller's kernels run instead, as
    `_run_compiled`'s do)."""
    global _kernel
    if name in _broken:
        return False
    launch = _launch_args(name, args)
    if launch is None:
        return False
    x, scale, o, ot, used, amax, flags = launch
    # what Triton compiles a variant for: dtypes, flags, each pointer's 16-byte alignment,
    # each size's divisibility by 16 and whether it is 1, each pointer's dtype, the device
    tensors = (x, scale, o, ot, used, amax)
    signature = (x.dtype, o.dtype, tuple(flags.values()),
                 tuple(t.data_ptr() % 16 == 0 for t in tensors),
                 tuple((d % 16 == 0, d == 1) for d in x.shape),
                 tuple(t.dtype for t in tensors), x.device)
    if capturing and signature not in _seen:
        return False
    try:
        if _kernel is None:
            _kernel = _make()
        m, n = x.shape
        bm, bn, warps = BLOCK
        fmax = float(torch.finfo(o.dtype).max) if flags["CAST"] else 0.0
        grid = ((m + bm - 1) // bm, (n + bn - 1) // bn)
        _kernel[grid](x, scale, o, ot, used, amax, m, n, FMAX=fmax, BM=bm, BN=bn,
                      num_warps=warps, **flags)
    except Exception as exc:  # noqa: BLE001  (no Triton, or it failed: the caller's kernels run)
        if capturing:
            raise
        _broken.update(KERNELS if _kernel is None else (name,))  # no Triton here: none runs
        log.warning("megatron_overlap: FP8 %s runs as compiled kernels: its Triton kernel "
                    "failed (%s: %s)", name, type(exc).__name__, exc)
        return False
    _seen.add(signature)
    return True
