"""Hand-written Triton kernels for FP8's casts and transposed copies on a GPU, where the
compiled ones (`overlap.fp8._run_compiled`) move more bytes than they need:

- `cast_transpose`: the cast writing both layouts an FP8 GEMM needs (Transformer Engine's
  cast-transpose), reading the wide tensor once. Inductor compiles that function to two
  kernels each reading it, so the layers cast and then transposed the FP8 values.
- `delayed_cast_amax` (`_t`: with the transposed copy): delayed scaling's cast with the
  history's scale, which also reduces the tensor's amax (max |x|, atomically per tile,
  into a scalar zeroed before) and copies the scale pair used (`overlap.fp8.scale_pair`):
  the amax needs no pass of its own.
- `current_cast` (`_t`: with the transposed copy): current scaling's cast, which makes
  its scale from the tensor's amax (the TP group's amaxes' max, for a tensor gathered)
  and writes the scale pair (`overlap.fp8.scale_pair`) beside it: no kernel of its own
  for the scale, nor for the group's max.
- Any cast can write its output chunk-major (`chunks`: `overlap.fp8.chunk_major`), the
  layout in which a GEMM->RS pipeline chunk's rows are adjacent (a row layer's FP8 input):
  the pipeline's GEMMs read them in place where they were copied together before.
- `transpose`: 1-byte values transposed. Inductor's kernel moved them at ~1.3 TB/s on an
  H100 (its fp8 layers' transposes), this one at ~2.9 TB/s.
- `delayed_update`: delayed scaling's update of a pass's histories at its end (rows of
  a layer's block): the group's max of each amax, the history shifted, the scale pair
  from the window, one program a history, where inductor's compile of the same function
  was several kernels, each a dependent launch on the pass's stream.
- `amax`: current scaling's max |x|, the same atomic reduction over tiles as the delayed
  cast's, into a scalar zeroed first. torch's reduction (`linalg.vector_norm`, one memset
  and one kernel as well) read an 8192 x 8192 bf16 tensor at ~2.4 TB/s on an H100, and
  a layer's 12 amaxes took 272 of its 6966 us of kernels at 70B TP=8.

Every amax here is an integer max over the bits of |x| with the sign bit cleared: |x| >= 0
orders as its bits, and a NaN (above inf) wins, so a NaN anywhere makes the amax NaN, as
torch's does, whatever sign the NaN's bits carry.

Each computes what `overlap.fp8`'s eager definition computes, bit for bit (the cast:
fp32 multiply, clamp with NaN kept, round to nearest even; checked on the GPU:
tests/gpu/test_fp8_cast_gpu.py). Measured one by one against the compiled kernels:
`benchmarks/probe_fp8_transpose.py`. The kernels themselves are overlap/fp8_triton.py,
imported at the first call (the runtime imports without Triton; on CPU they never run).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch

log = logging.getLogger("megatron_overlap")

KERNELS = ("cast_transpose", "current_cast", "current_cast_t", "delayed_cast_amax",
           "delayed_cast_amax_t", "transpose", "amax", "delayed_update")
BLOCK = (64, 128, 4)  # rows, columns, warps of a tile: the probe's best over a layer's tensors
AMAX_BLOCK = (8192, 8)  # elements, warps of an amax program
_kernels: Optional[dict] = None  # the Triton kernels by name, made at the first call
_seen: set = set()  # launch signatures compiled so far (a capture never compiles)
_broken: set = set()  # names that failed once: not tried again (the caller's path runs)


def _make() -> dict:
    from . import fp8_triton  # (imports Triton)

    return {"cast_t": fp8_triton.cast_t, "amax": fp8_triton.fp8_amax,
            "delayed_update": fp8_triton.delayed_update}


def _flat2d(t: torch.Tensor) -> Optional[torch.Tensor]:
    """`t` as a contiguous 2-D view ([rows, last dim]), or None."""
    if not t.is_contiguous() or t.dim() == 0:
        return None
    return t.view(-1, t.shape[-1]) if t.dim() != 2 else t


MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis (the tiles across the columns)
# A scale pair: [1 / scale, scale], the inverse first, at the start of its allocation:
# cuBLASLt refuses a scale pointer not 16-byte aligned (CUBLAS_STATUS_NOT_SUPPORTED), and
# the scaled GEMM passes the inverse's address as it is; a cast reads the scale anywhere.
PAIR = (2,)
INVERSE_AT, SCALE_AT = 0, 1
MAX_AMAXES = 1024  # the most amaxes (a TP group's) a current cast reduces for its scale
MAX_HISTORY = 8192  # the longest amax history `delayed_update` takes (one program a row)


def triton_pow2(n: int) -> int:
    """The power of two >= n (a Triton block's length)."""
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class Launch:
    """One launch: the kernel, its tensor arguments, sizes, constexpr flags, grid, warps."""

    kernel: str
    tensors: tuple
    sizes: tuple
    flags: dict
    grid: tuple
    warps: int


def _amax_launch(args: tuple) -> Optional[Launch]:
    x, out = args
    if (not x.is_contiguous() or x.numel() == 0 or out.dtype != torch.float32
            or out.numel() != 1 or not x.is_floating_point()):
        return None
    block, warps = AMAX_BLOCK
    return Launch("amax", (x, out), (x.numel(),), dict(BLOCK=block),
                  (-(-x.numel() // block),), warps)


def _update_launch(args: tuple, consts: dict) -> Optional[Launch]:
    """`delayed_update` on (history [n, L], every [world, n], scale [n, 2]), `consts` its
    fp8_max, margin and algo; None where the tensors are not fp32 rows it takes."""
    h, every, s = args
    if (consts is None or h.dim() != 2 or s.shape != (h.shape[0], *PAIR) or every.dim() != 2
            or every.shape[1] != h.shape[0] or any(t.dtype != torch.float32 for t in args)
            or not (h.is_contiguous() and s.is_contiguous()) or every.stride(1) != 1
            or not 0 < h.shape[1] <= MAX_HISTORY or not 0 < every.shape[0] <= MAX_AMAXES
            or h.shape[0] == 0 or not h.device == every.device == s.device):
        return None
    bl = triton_pow2(h.shape[1])
    return Launch("delayed_update", (h, every, s), (h.shape[1], every.shape[0], every.stride(0)),
                  dict(FMAX=consts["fp8_max"], DIV=2.0 ** consts["margin"],
                       USE_MAX=consts["algo"] == "max", BL=bl,
                       BW=triton_pow2(every.shape[0])),
                  (h.shape[0],), 1 if bl <= 1024 else 4)


def _cast_layout(x: torch.Tensor, o: torch.Tensor, ot: Optional[torch.Tensor]
                 ) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
    """(x, o) as the [rows, last dim] matrices a cast reads and writes, or None where o is
    not x's shape or ot (when given) not x's transposed one."""
    x2, o2 = _flat2d(x), _flat2d(o)
    if x2 is None or o2 is None or o2.shape != x2.shape:
        return None
    if ot is not None and (x.dim() != 2 or not ot.is_contiguous() or ot.shape != x.shape[::-1]):
        return None
    return x2, o2


def _launch(name: str, args: tuple, chunks: tuple[int, int] = (1, 1),
            consts: Optional[dict] = None) -> Optional[Launch]:
    """The launch that runs kernel `name` on `args`, or None where it does not run these
    tensors: a layout or shape it does not take (each output exactly the input's shape,
    or its transpose's), a scale per row, scalars not float32 (a cast's scale one value,
    delayed's scale and the one it copies out pairs, a current cast's amaxes a vector of
    at most MAX_AMAXES and its scale out a pair), no elements, more column tiles than a
    grid holds. `chunks` (blocks, chunks per block): a cast's output rows chunk-major
    (`overlap.fp8.chunk_major`); rows that do not divide into them are not taken.
    `consts`: what a kernel takes beside its tensors (`delayed_update`'s rule)."""
    if name == "delayed_update":
        return _update_launch(args, consts) if chunks == (1, 1) else None
    if name == "amax":
        return _amax_launch(args) if chunks == (1, 1) else None
    if name == "transpose":
        x, ot = args
        if (x.dim() != 2 or not (x.is_contiguous() and ot.is_contiguous())
                or ot.shape != x.shape[::-1] or x.element_size() != 1 or ot.element_size() != 1):
            return None  # (bytes only: the kernel moves them as uint8)
        x2, tensors = x, (x, x, x, ot, x, x, x)
        flags, na = dict(CAST=False, WRITE_T=True, AMAX=False, FROM_AMAX=False, FMAX=0.0), 1
    elif name.startswith("current_cast"):
        (x, amaxes, pair, o), ot = args[:4], (args[4] if len(args) > 4 else None)
        layout, na = _cast_layout(x, o, ot), amaxes.numel()
        if (layout is None or amaxes.dtype != torch.float32
                or pair.dtype != torch.float32 or pair.shape != PAIR or not pair.is_contiguous()
                or amaxes.dim() != 1 or not amaxes.is_contiguous() or not 0 < na <= MAX_AMAXES
                or not amaxes.device == pair.device == x.device):
            return None
        x2, o2 = layout
        tensors = (x2, amaxes, o2, ot if ot is not None else o2, pair, amaxes, x2)
        flags = dict(CAST=True, WRITE_T=ot is not None, AMAX=False, FROM_AMAX=True,
                     FMAX=float(torch.finfo(o.dtype).max))
    else:
        if name == "cast_transpose":
            x, scale, o, ot = args
            used = amax = None
        elif name == "delayed_cast_amax":
            (x, scale, used, amax, o), ot = args, None
        else:
            x, scale, used, amax, o, ot = args
        layout, pairs = _cast_layout(x, o, ot), (scale, used) if amax is not None else ()
        if (layout is None
                or any(t.dtype != torch.float32 for t in (scale, used, amax) if t is not None)
                or (scale.numel() != 1 if amax is None else amax.numel() != 1)
                or any(t.shape != PAIR or not t.is_contiguous() for t in pairs)):
            return None
        x2, o2 = layout
        scale = scale.reshape(()) if amax is None else scale
        tensors = (x2, scale, o2, ot if ot is not None else o2,
                   used if used is not None else scale, amax if amax is not None else scale, x2)
        flags = dict(CAST=True, WRITE_T=ot is not None, AMAX=amax is not None, FROM_AMAX=False,
                     FMAX=float(torch.finfo(o.dtype).max))
        na = 1
    if x2.numel() == 0 or -(-x2.shape[1] // BLOCK[1]) > MAX_GRID_Y:
        return None
    (m, n), (bm, bn, warps) = x2.shape, BLOCK
    chunk_major = chunks != (1, 1)
    if chunk_major and (not flags["CAST"] or min(chunks) < 1 or m % (chunks[0] * chunks[1])):
        return None
    # a float32 x's transposed copy from the bytes written to o (fp8_triton.cast_t says why)
    t_from_o = flags["CAST"] and flags["WRITE_T"] and x2.dtype == torch.float32
    return Launch("cast_t", tensors, (m, n, na, *chunks, 0),
                  {**flags, "T_FROM_O": t_from_o, "CHUNK_MAJOR": chunk_major,
                   "NA": triton_pow2(na), "ACT": 0, "AMAX_ONLY": False, "BM": bm, "BN": bn},
                  (-(-m // bm), -(-n // bn)), warps)


ACTS = {"swiglu": 1, "swiglu_grad": 2}  # fp8_triton.swiglu_tile's ACT of each activation
ACT_MODES = ("amax", "current", "delayed")
EVERY = (*KERNELS, *(f"{a}_{m}" for a in ACTS for m in ACT_MODES))  # every name `_go` runs


def act_launch(act: str, mode: str, y: torch.Tensor, g: Optional[torch.Tensor],
               amax: torch.Tensor, o: Optional[torch.Tensor] = None,
               ot: Optional[torch.Tensor] = None, scale: Optional[torch.Tensor] = None,
               used: Optional[torch.Tensor] = None, chunks: tuple[int, int] = (1, 1)
               ) -> Optional[Launch]:
    """The cast kernel with `act` made in its tiles from y ([..., 2 h] contiguous: gate,
    up) and, for 'swiglu_grad', the output gradient g ([..., h], y's dtype): `mode`
    'amax' (max |x| into `amax`, nothing written), 'current' (the scale from the amax
    at `amax`, written with its inverse into the pair `used`, then the cast) or
    'delayed' (the cast with the pair `scale`, copied into `used`, its amax into
    `amax`); o [m, n] (chunk-major with `chunks`) and ot [n, m] as the other casts'.
    None where these tensors do not fit."""
    y2 = _flat2d(y)
    if y2 is None or y2.shape[1] % 2 or not y2.is_floating_point() or y2.numel() == 0:
        return None
    m, nh = y2.shape[0], y2.shape[1] // 2
    n = nh if act == "swiglu" else 2 * nh
    g2 = None if g is None else _flat2d(g)
    if (act not in ACTS or mode not in ACT_MODES or (g2 is None) != (act == "swiglu")
            or (g2 is not None and (g2.shape != (m, nh) or g2.dtype != y2.dtype))
            or amax.dtype != torch.float32 or amax.numel() != 1 or -(-n // BLOCK[1]) > MAX_GRID_Y):
        return None
    if mode != "amax":
        o2 = None if o is None else _flat2d(o)
        pairs = (used,) if mode == "current" else (scale, used)
        if (o2 is None or o2.shape != (m, n) or o2.element_size() != 1
                or any(t is None or t.dtype != torch.float32 or t.shape != PAIR
                       or not t.is_contiguous() for t in pairs)
                or (ot is not None and (not ot.is_contiguous() or ot.shape != (n, m)))):
            return None
    if chunks != (1, 1) and (mode == "amax" or min(chunks) < 1 or m % (chunks[0] * chunks[1])):
        return None
    bm, bn, warps = BLOCK
    if act == "swiglu_grad":  # each tile in one half (`swiglu_tile`): a width dividing it
        bn = next((w for w in (bn, bn // 2, bn // 4, bn // 8) if nh % w == 0), 0)
        if not bn:  # (16 divides every FP8 layer's widths: the layer refuses others)
            return None
    x = g2 if g2 is not None else y2  # (the kernel's x_ptr: the output gradient, or unread)
    o2 = o2 if mode != "amax" else x
    amax = amax.reshape(1)  # (current: the amaxes the scale is made from, one here)
    t = (x, amax if mode == "current" else (scale if mode == "delayed" else amax), o2,
         ot if ot is not None else o2, used if used is not None else amax, amax, y2)
    fmax = float(torch.finfo(o2.dtype).max) if mode != "amax" else 0.0
    # the transposed copy from the bytes written to o, as a float32 x's (fp8_triton.cast_t:
    # x is made in float32 here; the copy from registers has not run on a GPU)
    flags = dict(FMAX=fmax, CAST=True, WRITE_T=ot is not None and mode != "amax",
                 AMAX=mode == "delayed", FROM_AMAX=mode == "current", T_FROM_O=True,
                 CHUNK_MAJOR=chunks != (1, 1), NA=1, ACT=ACTS[act], AMAX_ONLY=mode == "amax",
                 BM=bm, BN=bn)
    return Launch("cast_t", t, (m, n, 1, *chunks, nh), flags, (-(-m // bm), -(-n // bn)), warps)


def run_act(act: str, mode: str, capturing: bool, y: torch.Tensor, g: Optional[torch.Tensor],
            amax: torch.Tensor, **kw) -> bool:
    """`act_launch`'s kernel run (its amax zeroed first where it reduces one); False where
    it does not run (`run`'s reasons)."""
    launch = None if f"{act}_{mode}" in _broken else act_launch(act, mode, y, g, amax, **kw)
    if launch is None:
        return False
    if mode != "current":
        amax.zero_()  # the atomic max's start (|x| >= 0)
    return _go(f"{act}_{mode}", launch, capturing)


def run(name: str, args: tuple, capturing: bool, chunks: tuple[int, int] = (1, 1),
        consts: Optional[dict] = None) -> bool:
    """Kernel `name` on `args` (the layout of its eager definition in overlap.fp8); False
    where it does not run: Triton missing, tensors it does not take, a failure before
    (logged once), or, inside a CUDA-graph capture, a launch signature not compiled yet
    (a compile there could break the capture: the caller's kernels run instead, as
    `_run_compiled`'s do). `chunks`: a cast's output rows chunk-major (`_launch`);
    `consts`: its constants beside the tensors (`_launch`)."""
    if name in _broken:
        return False
    launch = _launch(name, args, chunks, consts)
    if launch is None:
        return False
    if name == "amax":
        args[1].zero_()  # the atomic max's start (|x| >= 0)
    return _go(name, launch, capturing)


def _go(name: str, launch: Launch, capturing: bool) -> bool:
    """`launch` run for kernel `name` (`run`'s rules: compiled outside a capture only, a
    failure logged once and not tried again)."""
    global _kernels
    t = launch.tensors
    # what Triton compiles a variant for: the kernel, its flags, each pointer's dtype and
    # 16-byte alignment, each size's divisibility by 16, whether it is 1 and whether it
    # needs 64 bits, the device
    signature = (launch.kernel, tuple(launch.flags.items()), tuple(x.dtype for x in t),
                 tuple(x.data_ptr() % 16 == 0 for x in t),
                 tuple((d % 16 == 0, d == 1, d >= 2 ** 31) for d in launch.sizes), t[0].device)
    if capturing and signature not in _seen:
        return False
    try:
        if _kernels is None:
            _kernels = _make()
        _kernels[launch.kernel][launch.grid](*t, *launch.sizes, num_warps=launch.warps,
                                            **launch.flags)
    except Exception as exc:  # noqa: BLE001  (no Triton, or it failed: the caller's kernels run)
        if capturing:
            raise
        _broken.update(EVERY if _kernels is None else (name,))  # no Triton here: none runs
        log.warning("megatron_overlap: FP8 %s runs as compiled kernels: its Triton kernel "
                    "failed (%s: %s)", name, type(exc).__name__, exc)
        return False
    _seen.add(signature)
    return True
