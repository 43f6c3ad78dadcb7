"""FP8 at the GEMM seam: tensors quantized with per-tensor scales (current scaling,
Transformer Engine's and Megatron's 'tensorwise' recipe; or delayed scaling, their
'delayed': `AmaxHistory`, `delayed_quantize`, `update_scales`) or per-row scales
(torchao's 'rowwise'), and the scaled GEMMs that multiply them, which a schedule takes as its
`gemm`: the schedules stay one.

- Scaling and casting are torchao's float8 (`amax_to_scale`, `to_fp8_saturated`; the
  [fp8] extra), imported when FP8 first runs, so the runtime imports without it. A scale
  is torchao's: fp8 = saturate(x * scale), x ~ fp8 / scale. On a GPU the cast runs as one
  fused kernel (`_fused_cast`), the scale as one kernel (`scale_for`): torch.compile, each
  kernel in a frame of its own (`_own_frame`). The transposed copies FP8 GEMMs need, a cast
  that writes both layouts (`quantize(..., out_t=)`), delayed scaling's cast with its amax
  and current scaling's amax are hand-written Triton kernels instead
  (overlap/fp8_kernels.py: inductor compiled the two-layout cast to two kernels each
  reading the wide input, and moved 1-byte transposes at ~1.3 TB/s on an H100).
  `set_fused` turns all of them off.
- A per-tensor scale is kept as a pair, [1 / scale, scale] (`scale_pair`): the cast
  multiplies by the scale, the scaled GEMM takes the inverse, written by the kernel that
  makes the scale (`scale_for`; delayed scaling's `update_scales`), so no GEMM launches
  reciprocals of its own (two a GEMM: 24 kernels a layer's step).
- Own code, and why:
  - `ScaledGemm` calls `torch._scaled_mm` itself: the schedules write every chunk's
    product into its place of the pass's output (`out=`, the addresses a CUDA-graph
    replay keeps), which torchao's `addmm_float8_unwrapped` does not offer; and it checks
    cuBLAS's layout rules on every device (CPU runs any layout, the GPU does not), so a
    CPU test catches an operand a GPU would refuse.
  - `group_amaxes` (`shared_amax`, their max): the amax of a tensor that will be
    gathered is the maximum over the TP group (as TE's current scaling reduces it), so
    the gathered tensor has one scale and equals one whole-tensor quantization. The reduction is an all-gather of one float per
    rank through the transport (bounded, named, traced like every wait here); torchao's
    `reduce_amax` is an unbounded functional collective over a device mesh.
  - Delayed scaling: torchao's float8 scales dynamically only (no amax history);
    the history, TE's update rule and the cast with the history's scale are here, the cast
    through the same `_cast_by` as current scaling's.
  - Row-scaled tensors (`rows_quantized`) carry each row's scale in the row itself: a
    row of K FP8 values is followed by a `TAIL` of 16 bytes, its fp32 scale and 12 bytes
    of unspecified padding (16 keeps every row's start 16-byte aligned, as cuBLAS and CUTLASS need). Whatever a
    schedule does to rows (gather them into a workspace, slice them, view them batched)
    it does to their scales: no schedule or transport knows about them. `RowScaledGemm`
    splits a chunk into its FP8 values and its scales.
"""

from __future__ import annotations

import functools
import logging
import types
from typing import Optional

import torch

from ..comm import trace
from ..comm.transport import FLOAT8, Transport
from . import fp8_kernels
from .streams import off_capture


def _ao():
    from ..extras import require

    return require("torchao.float8.float8_utils", "FP8 in the overlapped linears")


def available() -> None:
    """Raise MissingExtra (naming the [fp8] extra) when torchao cannot be imported."""
    _ao()


def _amax_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32, out=out)


def amax(x: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """max |x| as a float32 scalar (into `out` when given): torchao's tensorwise amax (max
    of abs, exact), read in one pass (`tensor_to_amax` writes |x| first: three times the
    memory traffic). On a GPU the 'amax' Triton kernel (overlap/fp8_kernels.py), else
    torch's reduction."""
    x = x.detach()  # (never differentiated; torch refuses out= under autograd)
    if out is None:
        out = torch.empty((), dtype=torch.float32, device=x.device)
    if _run_compiled(("amax",), _amax_into, x, out):
        return out
    return _amax_into(x, out)


def group_amaxes(x: torch.Tensor, tp: Transport, op: str) -> torch.Tensor:
    """Every rank's max |x| ([world], fp32), whose max is the amax of the tensor a gather
    of `x` makes (its max the current cast takes itself).
    Collective over the TP group, inside the caller's transport pass."""
    return _gathered(amax(x).reshape(1), tp, op)


def shared_amax(x: torch.Tensor, tp: Transport, op: str) -> torch.Tensor:
    """max |x| over every rank of `tp`: the amax of the tensor a gather of `x` makes.
    Collective over the TP group, inside the caller's transport pass."""
    return group_amaxes(x, tp, op).amax()


def _gathered(local: torch.Tensor, tp: Transport, op: str) -> torch.Tensor:
    """`local` (fp32, [n]) of every rank of `tp`, [world * n]: one all-gather of n floats
    a rank through the transport (bounded and named like every wait here)."""
    if tp.world_size == 1:
        return local
    every = local.new_empty(tp.world_size * local.numel())
    tp.all_gather(every, local, op=op).wait()
    return every


def every_rank(local: torch.Tensor, tp: Transport, op: str) -> torch.Tensor:
    """`local` (fp32, [n]) of every rank of `tp`, [world, n] (one exchange)."""
    return _gathered(local, tp, op).view(tp.world_size, -1)


PAIR = fp8_kernels.PAIR  # a scale pair's shape (its layout: fp8_kernels.INVERSE_AT, SCALE_AT)


def scale_pair(device: torch.device | str) -> torch.Tensor:
    """An (unwritten) scale pair, fp32, an allocation of its own: the cast multiplies by
    its scale, the scaled GEMM (`ScaledGemm`) by its inverse, which cuBLASLt needs
    16-byte aligned (fp8_kernels.PAIR)."""
    return torch.empty(PAIR, dtype=torch.float32, device=device)


def pair_of(scale: torch.Tensor, inv: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A new scale pair of `scale` (0-d) and its inverse (`inverse(scale)` unless given);
    of a vector of n scales, n pairs ([n, 2])."""
    parts = [scale, scale]
    parts[fp8_kernels.INVERSE_AT] = inverse(scale) if inv is None else inv
    return torch.stack(parts, dim=-1)


def inverse(s: torch.Tensor) -> torch.Tensor:
    """1 / s in fp32, divided in fp64: the bits of fp32's correctly rounded reciprocal (a
    quotient rounded to fp64 and then to fp32 is rounded once: 53 >= 2 x 24 + 2 bits), the
    same compiled and eagerly, as torchao's fp64 scales."""
    return (1.0 / s.to(torch.float64)).to(torch.float32)


def scale_value(scale: torch.Tensor) -> torch.Tensor:
    """What a cast multiplies by: a pair's scale; any other scale (a value, a scale per
    row) itself."""
    return scale[fp8_kernels.SCALE_AT] if scale.shape == PAIR else scale


def scale_inverse(scale: torch.Tensor) -> torch.Tensor:
    """What a scaled GEMM multiplies by: a pair's inverse (no kernel); a bare value's
    reciprocal (a kernel)."""
    return scale[fp8_kernels.INVERSE_AT] if scale.shape == PAIR else scale.reciprocal()


def _scale_by(to_scale, dtype: torch.dtype, a: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    s = to_scale(a.amax(), dtype)  # (a vector of amaxes: their max, NaN kept)
    return out.copy_(pair_of(s))


def scale_for(a: torch.Tensor, dtype: torch.dtype, out: Optional[torch.Tensor] = None
              ) -> torch.Tensor:
    """The scale pair (`scale_pair`) whose scale maps amax `a` (or the max of a vector of
    amaxes) to `dtype`'s largest value (torchao's `amax_to_scale`), into `out` when given.
    On a GPU one compiled kernel
    writes both where eagerly it is nine: torchao computes the scale in fp64 so that
    compiled and eager give the same bits (tests/gpu/test_fp8_cast_gpu.py), and so does
    `inverse`."""
    if out is None:
        out = scale_pair(a.device)
    elif out.shape != PAIR or out.dtype != torch.float32:
        raise ValueError(f"scale_for: out is {tuple(out.shape)} {out.dtype}, not a scale pair "
                         f"(overlap.fp8.scale_pair)")
    fn = functools.partial(_scale_by, _ao().amax_to_scale, dtype)
    if _run_compiled(("scale", dtype, a.dim()), fn, a, out):
        return out
    return fn(a, out)


def _cast_by(saturate, x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The one definition of the numbers: out = saturate(fp32(x) * scale) (torchao's)."""
    return out.copy_(saturate(x.to(torch.float32) * scale, out.dtype))


def _cast(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return _cast_by(_ao().to_fp8_saturated, x, scale, out)


_compiled: dict = {}  # kernel key -> its torch.compile'd function; None: eager from now on
_BACKEND = "inductor"  # (tests on CPU: dynamo's "eager", the same frames, guards and variants)
_fusing = True
log = logging.getLogger("megatron_overlap")


def set_fused(enabled: bool) -> bool:
    """Whether FP8 casts, scales and transposes run as compiled and Triton kernels on a GPU
    (the default) or eagerly; returns the previous setting. For side-by-side benchmarks: a
    pass captured for replay keeps the kernels it was captured with."""
    global _fusing
    before, _fusing = _fusing, bool(enabled)
    return before


def _own_frame(fn, key: tuple):
    """`fn` called from a function whose code object is its own, one per kernel key.
    Dynamo keeps a code object's compiled variants, and its recompile limit
    (torch._dynamo.config.recompile_limit, 8 by default), per code object, and every
    `functools.partial` it compiles runs in one shared wrapper frame: past the limit among
    all of them, the next ran eagerly, one warning from dynamo in the log (seen on an
    H200: the FP8 casts of a process that had compiled 8 others). The frame's name says
    the key (`fp8_cast_bfloat16_float8_e4m3fn`), in that warning too."""
    def kernel(*args: torch.Tensor):
        return fn(*args)
    name = "fp8_" + "_".join(str(k).removeprefix("torch.") for k in key)
    code = kernel.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, kernel.__globals__, name, None, kernel.__closure__)


def _run_compiled(key: tuple, fn, *args: torch.Tensor, dynamic: bool = True,
                  chunks: Optional[tuple[int, int]] = None, consts: Optional[dict] = None
                  ) -> bool:
    """Run `fn(*args)` as one GPU kernel: for the keys overlap/fp8_kernels.py writes in
    Triton, that kernel; else compiled (torch.compile, inductor; dynamic shapes, so a model's
    shapes compile once per key; `dynamic=False`: specialized to the first call's shapes,
    for a key whose shapes never change); False where it does not run so: on CPU, with
    `set_fused(False)`, or after a failure (logged once; that key runs eagerly from then
    on, with the same bits; a Triton kernel's key, the caller's compiled or eager kernels),
    or for tensors a Triton kernel does not take. Inside a CUDA-graph capture it never
    compiles (a compile synchronizes, which a capture forbids): a kernel not compiled yet,
    or one whose guards ask for a recompile (a new layout, a dimension of 1), runs eagerly
    there, captured so. `chunks`: a cast's output chunk-major, by its Triton kernel only
    (`fp8_kernels.run`); `consts`: a Triton kernel's constants beside its tensors (what
    `fn` has bound)."""
    if not _fusing or args[0].device.type != "cuda":
        return False
    capturing = torch.cuda.is_current_stream_capturing()
    if key[0] in fp8_kernels.KERNELS:  # hand-written in Triton (inductor's `fn` moves more bytes)
        if fp8_kernels.run(key[0], args, capturing, chunks or (1, 1), consts):
            return True
        if key[0] not in ("transpose", "delayed_update") or chunks:  # declined: the caller's
            # other kernels run instead (these two: their compiled function)
            return False
    return _call_compiled(key, fn, args, dynamic, capturing)


def _call_compiled(key: tuple, fn, args: tuple, dynamic: bool, capturing: bool) -> bool:
    """`_run_compiled` past its device check."""
    if key not in _compiled:
        if capturing:
            return False
        _compiled[key] = torch.compile(_own_frame(fn, key), dynamic=dynamic, backend=_BACKEND)
    compiled = _compiled[key]
    if compiled is None:
        return False
    try:
        if capturing:
            with torch.compiler.set_stance("fail_on_recompile"):
                compiled(*args)
        else:
            compiled(*args)
    except Exception as exc:  # noqa: BLE001  (no inductor / triton here: eager, slower, same bits)
        if capturing:  # a recompile refused: eager in this capture, compiled again outside
            return False
        _compiled[key] = None
        log.warning("megatron_overlap: FP8 %s runs eagerly: torch.compile failed (%s: %s)",
                    key[0], type(exc).__name__, exc)
        return False
    return True


def _fused_cast(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> Optional[torch.Tensor]:
    """`_cast` as one kernel on a GPU, or None where it does not run so: eagerly the cast is
    four passes over fp32 temporaries (upcast, multiply, clamp, cast: ~27 bytes of memory
    traffic per element where 3 are needed), which cost an FP8 layer more than its GEMMs
    save. torch.compile (inductor) fuses the same ops, elementwise in fp32, rounding to
    nearest even as eager does: the same bits (tests/gpu/test_fp8_cast_gpu.py). Compiled
    per dtype pair, on flat tensors of any length; per-tensor scales only (row-wise
    scales and strided views run eagerly)."""
    if scale.numel() != 1 or not (x.is_contiguous() and out.is_contiguous()):
        return None
    fn = functools.partial(_cast_by, _ao().to_fp8_saturated)
    if _run_compiled(("cast", x.dtype, out.dtype), fn, x.view(-1), scale, out.view(-1)):
        return out
    return None


def _transpose_into(t: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(t.t())


def transposed(t: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """2-D `t` transposed into a new contiguous tensor. FP8 operands need it: cuBLAS takes
    the second operand of an FP8 GEMM column-major and the wgrad's first row-major.
    torch's strided copy of 1-byte elements reads or writes one byte per 32-byte sector
    (an FP8 layer's transposes measured ~0.8 TB/s of reads + writes on an H200); on a GPU
    the copy is compiled instead, which inductor tiles so that both sides are coalesced.
    FP8 moves as bytes (a copy: exact). Into `out` (contiguous) when given."""
    out = t.new_empty(t.shape[1], t.shape[0]) if out is None else out
    if t.element_size() == 1 and _run_compiled(("transpose",), _transpose_into,
                                               t.view(torch.uint8), out.view(torch.uint8)):
        return out
    return out.copy_(t.t())


def _fp8_out(x: torch.Tensor, dtype: torch.dtype, out: Optional[torch.Tensor],
             out_t: Optional[torch.Tensor]) -> torch.Tensor:
    """`out`, or a new tensor like `x` in `dtype`; `out_t` checked to be x's transposed
    shape in `dtype`."""
    if out is None:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    elif out.dtype != dtype:
        raise TypeError(f"quantize: out is {out.dtype}, not {dtype}")
    if out_t is not None and (out_t.dtype != dtype or x.dim() != 2
                              or out_t.shape != x.shape[::-1]):
        raise ValueError(f"quantize: out_t {tuple(out_t.shape)} {out_t.dtype} is not "
                         f"{tuple(x.shape[::-1])} {dtype}")
    return out


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
             out: Optional[torch.Tensor] = None, out_t: Optional[torch.Tensor] = None
             ) -> torch.Tensor:
    """saturate(x * scale) in `dtype` (x upcast to fp32 first), into `out` when given;
    `scale`: a scale pair (its scale, `scale_value`), a value or a scale per row. `out_t` (2-D
    `x`, a contiguous tensor of the transposed shape): the same values transposed written
    there too (the FP8 GEMMs' other layout), by the cast's own kernel on a GPU
    ('cast_transpose'), else `transposed` from the FP8 values."""
    out, scale = _fp8_out(x, dtype, out, out_t), scale_value(scale)
    if out_t is not None and _run_compiled(
            ("cast_transpose", x.dtype, dtype),
            functools.partial(_cast_t_by, _ao().to_fp8_saturated), x, scale, out, out_t):
        return out
    fused = _fused_cast(x, scale, out)
    out = fused if fused is not None else _cast(x, scale, out)
    if out_t is not None:
        transposed(out, out=out_t)
    return out


def chunk_major(t: torch.Tensor, blocks: int, chunks: int,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`t`'s rows ([blocks, chunks, sub] of them) reordered chunk-major ([chunks, blocks,
    sub]): row j of chunk i of block w moves to row j of block w within chunk i, so that a
    GEMM->RS pipeline chunk (chunk i of every rank's block) is one run of adjacent rows,
    which its FP8 GEMM reads in place (`chunk_major(t, chunks, blocks)` undoes it). Into
    `out` when given."""
    if t.dim() != 2 or blocks < 1 or chunks < 1 or t.shape[0] % (blocks * chunks):
        raise ValueError(f"chunk_major: a 2-D tensor whose rows split into {blocks} blocks "
                         f"of {chunks} chunks, not {tuple(t.shape)}")
    rows, k = t.shape
    out = torch.empty_like(t) if out is None else out
    src = t.view(blocks, chunks, rows // (blocks * chunks), k).transpose(0, 1)
    out.view(chunks, blocks, -1, k).copy_(src)
    return out


def row_input_chunks(scaling: str, method: str, scatter: bool, nodes, world: int,
                     num_splits: int) -> Optional[tuple[int, int]]:
    """The (blocks, chunks) in which a row layer's FP8 input is cast (`chunk_major`) for
    its forward's reduce-scatter, or None (x's row order): per-tensor scales (tensorwise,
    delayed) and the flat scattering pipeline (`gemm_rs.flat_pipeline`) over more than
    one rank and chunk. There each chunk's FP8 GEMM reads its rows in place; row-wise
    scales ride in the rows, whose chunks `batched` copies together."""
    from .gemm_rs import flat_pipeline

    if scaling == "rowwise" or world == 1 or num_splits == 1 or not flat_pipeline(
            method, scatter, nodes):
        return None
    return world, num_splits


def _chunk_major_by(natural, chunks: tuple[int, int], at: int, *args: torch.Tensor
                    ) -> torch.Tensor:
    """`natural(*args)` (a cast kernel's eager definition, in x's row order) with its
    output, `args[at]`, laid out chunk-major (`chunk_major`): what the kernel launched
    with `chunks` writes (the definition `_run_compiled`'s stand-ins run)."""
    out = args[at]
    tmp = torch.empty_like(out)
    natural(*args[:at], tmp, *args[at + 1:])
    return chunk_major(tmp, *chunks, out=out)


def _cast_chunk_major(key: tuple, fn, args: tuple, at: int, chunks: tuple[int, int],
                      row_order) -> torch.Tensor:
    """A cast whose output, `args[at]`, is laid out chunk-major: the kernel `key` names
    (`fn`: its eager definition in x's row order), else `row_order()`, the caller's cast
    into a new tensor in row order, reordered: the same bytes either way."""
    out = args[at]
    if not _run_compiled(key, functools.partial(_chunk_major_by, fn, chunks, at), *args,
                         chunks=chunks):
        chunk_major(row_order(), *chunks, out=out)
    return out


def _current_cast_by(to_scale, saturate, dtype: torch.dtype, x: torch.Tensor,
                     amaxes: torch.Tensor, pair: torch.Tensor, out: torch.Tensor,
                     out_t: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`scale_for` into `pair`, then `_cast_by` with it (and the values transposed into
    `out_t`): what the 'current_cast' kernels write (overlap/fp8_kernels.py)."""
    _scale_by(to_scale, dtype, amaxes, pair)
    _cast_by(saturate, x, scale_value(pair), out)
    return out if out_t is None else out_t.copy_(out.t())


def quantize_current(x: torch.Tensor, amaxes: torch.Tensor, dtype: torch.dtype,
                     pair: torch.Tensor, out: Optional[torch.Tensor] = None,
                     out_t: Optional[torch.Tensor] = None,
                     chunks: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """Current scaling: `x` quantized with the scale its amax gives (`amaxes`: `amax(x)`,
    or `group_amaxes`, whose max is taken), the scale pair written into `pair`; `out_t`
    as `quantize`'s. On a GPU one Triton kernel ('current_cast') makes the scale and
    casts; else `scale_for`, then `quantize`: the same bits. `chunks` (blocks, chunks per
    block): `out`'s rows chunk-major (`chunk_major`; `out_t` in x's order)."""
    out = _fp8_out(x, dtype, out, out_t)
    name, t = ("current_cast", ()) if out_t is None else ("current_cast_t", (out_t,))
    fn = functools.partial(_current_cast_by, _ao().amax_to_scale, _ao().to_fp8_saturated, dtype)
    args = (x, amaxes.reshape(-1), pair, out, *t)
    if chunks is not None:
        return _cast_chunk_major((name, x.dtype, dtype), fn, args, 3, chunks,
                                 lambda: quantize_current(x, amaxes, dtype, pair, None, out_t))
    if _run_compiled((name, x.dtype, dtype), fn, *args):
        return out
    return quantize(x, scale_for(amaxes, dtype, out=pair), dtype, out=out, out_t=out_t)


def _cast_t_by(saturate, x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor,
               out_t: torch.Tensor) -> torch.Tensor:
    """`_cast_by`, and its values transposed into `out_t`: what the 'cast_transpose'
    kernel writes (overlap/fp8_kernels.py), reading `x` once."""
    _cast_by(saturate, x, scale, out)
    return out_t.copy_(out.t())


class AmaxHistory:
    """One tensor's delayed scaling (Transformer Engine's `DelayedScaling`, Megatron's
    default fp8_recipe): the amaxes of its last `length` quantizations (oldest first) and
    the scale pair the next one uses (`scale_pair`), on the device, at fixed addresses (a
    replayed pass updates them in place). A new history quantizes with scale 1, as TE's
    does. `history`, `scale`: views to keep them in (a row of a layer's block, which
    `update_scales` updates with one kernel), else allocations of their own."""

    def __init__(self, length: int, device: torch.device,
                 history: Optional[torch.Tensor] = None, scale: Optional[torch.Tensor] = None):
        self.history = (torch.zeros(length, dtype=torch.float32, device=device)
                        if history is None else history.zero_())
        self.scale = (torch.ones(PAIR, dtype=torch.float32, device=device)
                      if scale is None else scale.fill_(1.0))

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.history, self.scale


def _delayed_cast_by(saturate, x: torch.Tensor, scale: torch.Tensor, used: torch.Tensor,
                     out: torch.Tensor) -> torch.Tensor:
    """`_cast_by` with the history's scale pair, copied into `used` (which this
    quantization's GEMMs and backward read)."""
    used.copy_(scale)
    return _cast_by(saturate, x, scale_value(used), out)


def _delayed_cast_amax_by(saturate, x: torch.Tensor, scale: torch.Tensor, used: torch.Tensor,
                          amax_out: torch.Tensor, out: torch.Tensor,
                          out_t: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`amax` and `_delayed_cast_by` (and the values transposed into `out_t`): what the
    'delayed_cast_amax' kernels write (overlap/fp8_kernels.py), reading `x` once."""
    _amax_into(x, amax_out)
    _delayed_cast_by(saturate, x, scale, used, out)
    return out if out_t is None else out_t.copy_(out.t())


def delayed_quantize(x: torch.Tensor, state: AmaxHistory, dtype: torch.dtype,
                     used: torch.Tensor, amax_out: torch.Tensor,
                     out: Optional[torch.Tensor] = None, out_t: Optional[torch.Tensor] = None,
                     chunks: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """`x` quantized with the scale `state` holds now (from past amaxes: no pass over x
    before the cast), its pair copied into `used` (a scale pair); x's own amax into
    `amax_out` (a 0-d float32
    tensor; a view into a larger one will do), for `update_scales` once it is the TP
    group's. `out_t`: the FP8 values transposed there too; `chunks`: `out`'s rows
    chunk-major (`quantize_current`'s). On a GPU one Triton kernel
    ('delayed_cast_amax', overlap/fp8_kernels.py) reads `x` once for all of it; else the
    amax is torch's own reduction, as current scaling's (`amax`), the cast one compiled
    kernel and the transposed copy `transposed`. (Compiled together by inductor, the amax
    was a split reduction ~15x slower than torch's: H100, 70B TP=8 layer, 3.9 of its 11.7
    ms.)"""
    out = _fp8_out(x, dtype, out, out_t)
    saturate = _ao().to_fp8_saturated
    x = x.detach()  # (the amax's out=: no autograd; neither needs it)
    amax_out.zero_()  # the kernel's amax is a max over its tiles from 0 (NaN-safe: bits)
    name, t = ("delayed_cast_amax", ()) if out_t is None else ("delayed_cast_amax_t", (out_t,))
    fn = functools.partial(_delayed_cast_amax_by, saturate)
    args = (x, state.scale, used, amax_out, out, *t)
    if chunks is not None:
        return _cast_chunk_major((name, x.dtype, dtype), fn, args, 4, chunks,
                                 lambda: delayed_quantize(x, state, dtype, used, amax_out,
                                                          None, out_t))
    if _run_compiled((name, x.dtype, dtype), fn, *args):
        return out
    amax(x, out=amax_out)
    fn = functools.partial(_delayed_cast_by, saturate)
    if not (x.is_contiguous() and out.is_contiguous() and _run_compiled(
            ("delayed_cast", x.dtype, dtype), fn, x.view(-1), state.scale, used,
            out.view(-1))):
        fn(x, state.scale, used, out)
    if out_t is not None:
        transposed(out, out=out_t)
    return out


def _update_by(use_max: bool, fp8_max: float, margin: int, history: torch.Tensor,
               every: torch.Tensor, scale: torch.Tensor) -> None:
    """TE's update, for n histories at once (`history` [n, L], `scale` [n, 2] pairs):
    `every` [world, n], each TP rank's amaxes, whose max (NaN kept) is the new amax; it
    goes in, the oldest out; the scale maps the window's max ('max') or the newest
    ('most_recent') to fp8_max / 2^margin, in fp64 (compiled and eager alike, as
    torchao's amax_to_scale), at most float32's largest; an amax of 0 or inf keeps the
    scale. A NaN amax is recorded as 0 (TE's reductions, fmaxf, skip NaN): it keeps the
    scale, and leaves a window's max to the other amaxes. The pair's inverse is written
    with its scale."""
    a = torch.nan_to_num(every.amax(0), nan=0.0, posinf=float("inf"))
    history.copy_(torch.cat([history[:, 1:], a[:, None]], dim=1))
    ref = (history.amax(1) if use_max else history[:, -1]).to(torch.float64)
    new = (fp8_max / ref / 2.0 ** margin).clamp(max=torch.finfo(torch.float32).max)
    ok = ((ref > 0) & torch.isfinite(ref))[:, None]
    scale.copy_(torch.where(ok, pair_of(new.to(torch.float32)), scale))


def update_scales(history: torch.Tensor, scale: torch.Tensor, every: torch.Tensor,
                  dtype: torch.dtype, margin: int, algo: str) -> None:
    """Record the new amaxes of n histories (`history` [n, L], `scale` [n, 2]: rows of a
    layer's block; `every` [world, n]: each TP rank's amaxes, the exchange's result as it
    is) and set the scales their next quantizations use (`algo`: 'max' over the history,
    or 'most_recent'). On a GPU one Triton kernel for all of it ('delayed_update',
    overlap/fp8_kernels.py), one program a history: a pass's group max and the updates
    of its two histories, each compiled on its own, were about seven kernels, each a
    dependent launch on the pass's stream. Where it does not run, compiled for the block's
    shape (a model's histories share one length: compiled for any length, the window's max
    was a loop of one thread block, 24 us a call for 1024 amaxes on an H200)."""
    fp8_max = float(torch.finfo(dtype).max)
    fn = functools.partial(_update_by, algo == "max", fp8_max, margin)
    key = ("delayed_update", algo, dtype, margin, *history.shape, every.shape[0])
    if not _run_compiled(key, fn, history, every, scale, dynamic=False,
                         consts=dict(fp8_max=fp8_max, margin=margin, algo=algo)):
        fn(history, every, scale)


def update_scale(state: AmaxHistory, a: torch.Tensor, dtype: torch.dtype, margin: int,
                 algo: str) -> None:
    """`update_scales` for one history and its amax `a` (a float32 scalar, the TP
    group's)."""
    update_scales(state.history.view(1, -1), state.scale.view(1, -1),
                  a.reshape(1, 1), dtype, margin, algo)


def row_scales(x: torch.Tensor, dtype: torch.dtype, dim: int = -1) -> torch.Tensor:
    """One scale per row of `x` (`dim`=-1; per column with `dim`=0), from the amax along
    `dim`, rounded down to a power of two (torchao's rowwise recipe: exact reciprocals)."""
    from torchao.float8.float8_utils import ScalingGranularity

    return _ao().tensor_to_scale(x, dtype, scaling_granularity=ScalingGranularity.AXISWISE,
                                 axiswise_dim=dim, round_scales_to_power_of_2=True)


TAIL = 16  # bytes after each row of a row-scaled FP8 tensor: its fp32 scale, then padding


def rows_quantized(x: torch.Tensor, dtype: torch.dtype, out: Optional[torch.Tensor] = None
                   ) -> torch.Tensor:
    """`x` [rows, k] as row-scaled FP8 [rows, k + TAIL]: each row quantized with its own
    scale, which follows it (`row_data`, `row_scale`); into `out` when given."""
    rows, k = x.shape
    out = x.new_empty((rows, k + TAIL), dtype=dtype) if out is None else out
    s = row_scales(x, dtype)
    quantize(x, s, dtype, out=row_data(out))
    row_scale(out).copy_(s)
    return out


def row_data(t: torch.Tensor) -> torch.Tensor:
    """The FP8 values of row-scaled `t` (any leading dims): a strided view."""
    return t[..., :-TAIL]


def row_scale(t: torch.Tensor) -> torch.Tensor:
    """The fp32 scales of row-scaled `t`, [..., rows, 1]: a strided view."""
    return t[..., -TAIL:4 - TAIL].view(torch.float32)


def rows_dequantized(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Row-scaled `t` back in `dtype` (each row divided by its scale)."""
    return (row_data(t).float() / row_scale(t)).to(dtype)


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
    (torchao's meaning; pairs, whose inverses it reads, or values, whose reciprocals it
    takes), through torch._scaled_mm: the schedules' `gemm` for an FP8 pass. The product
    is `out`'s dtype, or `out_dtype` (bf16 or fp32), never FP8. `fast_accum`: torch's
    use_fast_accum (on Hopper the tensor cores' accumulator, not promoted to fp32 as the
    sum goes: faster, less exact; `layers.precision.Precision.fast_accum` says which GEMMs; asked
    of every caller, so that none falls back to one in silence)."""

    def __init__(self, a_scale: torch.Tensor, b_scale: torch.Tensor, out_dtype: torch.dtype, *,
                 fast_accum: bool):
        self.a_inv, self.b_inv = scale_inverse(a_scale), scale_inverse(b_scale)
        for name, inv in (("a", self.a_inv), ("b", self.b_inv)):
            if inv.data_ptr() % 16:  # (checked on every device: a CPU takes any address)
                raise ValueError(
                    f"ScaledGemm: the inverse of scale {name} lies {inv.data_ptr() % 16} bytes "
                    f"past a 16-byte boundary, which cuBLASLt refuses (CUBLAS_STATUS_NOT_"
                    f"SUPPORTED); keep scales in pairs of their own (overlap.fp8.scale_pair)")
        self.out_dtype, self.fast_accum = out_dtype, fast_accum

    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                 op: str, chunk: int = 0) -> torch.Tensor:
        trace.record("gemm", op, chunk)
        _check(a, b, op)
        dtype = out.dtype if out is not None else self.out_dtype
        if a.dim() == 3 and out is None:
            out = a.new_empty(a.shape[0], a.shape[1], b.shape[-1], dtype=dtype)

        def mm(a2: torch.Tensor, b2: torch.Tensor, o: Optional[torch.Tensor]) -> torch.Tensor:
            kw = {} if o is None else {"out": o}
            return torch._scaled_mm(a2, b2, scale_a=self.a_inv, scale_b=self.b_inv,
                                    out_dtype=dtype, use_fast_accum=self.fast_accum, **kw)
        with off_capture():
            return batched(a, b, out, mm) if a.dim() == 3 else mm(a, b, out)


def batched(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, mm) -> torch.Tensor:
    """3-D `a @ b` into `out` through the 2-D GEMM `mm(a2, b2, out2)` (_scaled_mm has no
    batched form). Where `b` is one matrix for every entry (a GEMM->RS pipeline chunk: the
    weight, expanded) and `out` is contiguous, one GEMM over all the entries' rows: the
    entries (strided rows of the pass's input: row-wise scales, a column dgrad's gradient;
    a row layer's input with per-tensor scales comes chunk-major, `row_input_chunks`, and
    is not batched) copied together first, FP8 bytes that cost far less than a launch and
    a wave tail per entry (TP of them per chunk). Otherwise one GEMM per entry."""
    if b.stride(0) == 0 and out.is_contiguous():
        mm(a.reshape(-1, a.shape[-1]), b[0], out.view(-1, out.shape[-1]))
        return out
    for i in range(a.shape[0]):
        mm(a[i], b[i], out[i])
    return out


def _check_rowwise(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, op: str) -> None:
    """torch's row-wise FP8 GEMM rules, as strict as its strictest path (CUTLASS's
    f8f8bf16_rowwise; cuBLASLt on sm90 with CUDA 12.9+ takes more): the second operand
    e4m3 (the first e4m3 or e5m2), bf16 output, and cuBLAS's layout rules (`_check`)."""
    _check(a, b, op)
    if b.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{op}: a row-wise FP8 GEMM takes its second operand in e4m3, got "
                        f"{b.dtype}")
    if out_dtype != torch.bfloat16:
        raise TypeError(f"{op}: a row-wise FP8 GEMM outputs bf16, asked for {out_dtype}")


class RowScaledGemm:
    """`a @ b` of a row-scaled FP8 `a` (`rows_quantized`: its scales travel in its rows)
    and an FP8 `b` with one scale per output column (`b_scale`, [1, n], torchao's
    meaning), through torch._scaled_mm with row-wise scales: the schedules' `gemm` for
    a 'rowwise' pass. Outputs bf16 (`out`'s dtype, or `out_dtype`); `fast_accum` as
    `ScaledGemm`'s."""

    def __init__(self, b_scale: torch.Tensor, out_dtype: torch.dtype, *, fast_accum: bool):
        self.b_inv = b_scale.reciprocal().contiguous()
        self.out_dtype, self.fast_accum = out_dtype, fast_accum

    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                 op: str, chunk: int = 0) -> torch.Tensor:
        trace.record("gemm", op, chunk)
        data = row_data(a)
        dtype = out.dtype if out is not None else self.out_dtype
        _check_rowwise(data, b, dtype, op)
        if out is None:
            out = a.new_empty(*data.shape[:-1], b.shape[-1], dtype=dtype)

        def mm(a2: torch.Tensor, b2: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
            inv = row_scale(a2).reciprocal()  # the rows' scales, contiguous
            return torch._scaled_mm(row_data(a2), b2, scale_a=inv, scale_b=self.b_inv,
                                    out_dtype=dtype, use_fast_accum=self.fast_accum, out=o)
        with off_capture():  # 3-D: the scales travel with the rows, through batched()'s copy too
            return batched(a, b, out, mm) if a.dim() == 3 else mm(a, b, out)
