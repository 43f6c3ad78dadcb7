"""A ring all-gather's GEMM as one kernel whose tiles wait per block (Flux's AG+GEMM).

The ring (`ag_gemm.ring_exchange`) multiplies each arrived block by a GEMM of its own. At
a layer's small N those fill the chip poorly: at 70B TP=8 the qkv forward's and the proj
dgrad's chunk GEMMs keep 0.6-0.8 of one whole GEMM (docs/results.md). Here one persistent
Triton kernel (`wait_gemm_triton`: through TMA on Hopper, else through pointers) runs
every tile of the whole product, in the order the blocks arrive; a tile spins on its
block's flag before it reads the block's rows. The flags are set from a side stream once
each transfer's handle completes, by a stream memory write (no SM), so the GEMM pays no
launch and no partly filled last wave per block.

The kernel keeps every SM but `SM_LEFT` for its whole run, so the transfers it waits for
must get by with those: it runs only on transports whose transfers ride copy engines with
one-block signal kernels (`Transport.why_no_wait` empty: symm, and the one-GPU null and
mirror). Operands: bf16 or fp16, or FP8 with per-tensor scales (`fp8.ScaledGemm`); rows
per block, N and K in whole tiles (`config`). Where it cannot run, `why_not` says why and
the ring's chunk GEMMs run. Each wait is bounded: past the transport's timeout (and half
again) the kernel traps, a CUDA error, after the transport's watchdog has named the
transfer. On CPU (no Triton, no concurrency) the flags are all set when it launches, and
it checks that, then multiplies through the pass's GEMM seam.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Optional, Sequence

import torch

from .gemm import Gemm, matmul

log = logging.getLogger("megatron_overlap")

SM_LEFT = 1  # SMs the kernel leaves to the transfers' signal kernels and the flag writes
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, GROUP_M) by operand bytes: the best of
# benchmarks/probe_chunk_wait_gemm.py's configs on an H100 (through TMA: FP8 0.88-1.04 of
# cuBLAS on the whole input at the passes whose chunk GEMMs keep least, bf16 0.85-1.00;
# those FP8 tiles accumulated fast where cuBLAS promoted: not re-probed since the kernel
# accumulates as the pass does), then a narrower tile, on 4 warps (through TMA 1-2% ahead
# of 8 at every probed pass)
CONFIGS: dict[int, tuple[tuple[int, int, int, int, int, int], ...]] = {
    1: ((128, 256, 128, 8, 3, 8), (128, 128, 128, 4, 4, 8)),
    2: ((128, 256, 64, 8, 3, 8), (128, 128, 64, 4, 4, 8)),
    4: ((128, 128, 64, 4, 1, 2),),  # fp32: Triton's CPU interpreter only (why_not refuses a
}                                   # GPU's fp32 GEMM, which the kernel would run in TF32)
OFFSETS = 2 ** 31  # the pointer kernel's element offsets are int32: M x K and M x N stay
# below (the TMA kernel is held to the same bound; it has not run beyond it)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
_flags: dict[tuple[str, int], torch.Tensor] = {}
_orders: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
_side: dict[str, torch.cuda.Stream] = {}
_warned: set[tuple[str, str]] = set()  # (pass, reason) of each fall-back said
_one_queue_said = False


def config(dtype: torch.dtype, rows: int, n: int, k: int, m: int = 0, programs: int = 0
           ) -> Optional[tuple]:
    """The tile config for operands of `dtype`, `rows` per block, N and K; None when no
    config's tiles divide them. Given the input's rows `m` and the kernel's `programs`, the
    one whose tiles fill the last wave best, the first listed within 5 points of it (at 70B's
    qkv, N 1280: 320 tiles of 256 columns take 3 waves of 131 at 81%, 640 of 128 take 5
    at 98%, and ran 4% faster on an H100)."""
    fits = [c for c in CONFIGS.get(dtype.itemsize, ())
            if rows % c[0] == 0 and n % c[1] == 0 and k % c[2] == 0]
    if not fits or not (m and programs):
        return fits[0] if fits else None

    def filled(c: tuple) -> float:
        tiles = (m // c[0]) * (n // c[1])
        return tiles / (-(-tiles // programs) * programs)
    best = max(map(filled, fits))
    return next(c for c in fits if filled(c) >= best - 0.05)


def why_not(x: torch.Tensor, wt: torch.Tensor, gemm: Gemm, why_no_wait: str, rows: int,
            blocks: int = 1) -> Optional[str]:
    """Why `blocks` blocks like `x` ([rows, K] each) times `wt` ([K, N]) cannot run as one
    waiting GEMM through `gemm` on a transport whose `why_no_wait` reason is `why_no_wait`
    ("": it can), or None."""
    from .fp8 import ScaledGemm

    if why_no_wait:
        return why_no_wait
    if gemm is not matmul and type(gemm) is not ScaledGemm:
        return (f"its GEMM is {type(gemm).__name__}; one waiting GEMM takes bf16 / fp16 "
                "operands or FP8 ones with per-tensor scales")
    k, n = wt.shape
    if x.device.type != "cuda":  # CPU: the seam's GEMM once every flag is set (module docstring)
        return _too_big(blocks * rows, k, n)
    why = why_not_shape(x.dtype, rows, k, n, blocks)
    if why:
        return why
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed"
    return None


def _too_big(m: int, k: int, n: int) -> Optional[str]:
    if max(m * k, m * n) >= OFFSETS:
        return f"its [{m}, {k}] x [{k}, {n}] GEMM has 2**31 elements or more (int32 offsets)"
    return None


def why_not_shape(dtype: torch.dtype, rows: int, k: int, n: int, blocks: int) -> Optional[str]:
    """What `why_not` says of a GPU's operands of `dtype` ([rows, K] blocks, K x N), or None:
    the part the tuner's search asks before it tries the key (`simulate.space.trials`)."""
    too_big = _too_big(blocks * rows, k, n)
    if too_big:
        return too_big
    if dtype not in (torch.bfloat16, torch.float16, *FP8):
        return f"its operands are {dtype}; the kernel takes bf16, fp16 or FP8"
    if config(dtype, rows, n, k) is None:
        tiles = ", ".join(f"{c[0]}-row blocks, N in {c[1]}s, K in {c[2]}s"
                          for c in CONFIGS[dtype.itemsize])
        return f"{rows} rows a block, N {n}, K {k} are not whole tiles ({tiles})"
    return None


def fall_back(op: str, reason: str) -> None:
    """Say once per pass and reason that `op` runs the ring's chunk GEMMs instead."""
    if (op, reason) not in _warned:
        _warned.add((op, reason))
        log.warning("megatron_overlap: %s: wait_gemm runs the ring's chunk GEMMs instead of "
                    "one waiting GEMM: %s (set wait_gemm: false for this layer to run them "
                    "without this message)", op, reason)


def fell_back() -> set[tuple[str, str]]:
    """(pass, reason) of every fall-back said so far in this process (the benchmarks
    report them beside the arm that asked for the waiting GEMM)."""
    return set(_warned)


def one_queue(op: str) -> None:
    """Say once that under CUDA_DEVICE_MAX_CONNECTIONS=1 the waiting GEMM starts only after
    the last block has landed (`FlagSide`): correct, but nothing overlaps."""
    global _one_queue_said
    if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1" and not _one_queue_said:
        _one_queue_said = True
        log.warning("megatron_overlap: %s: wait_gemm under CUDA_DEVICE_MAX_CONNECTIONS=1 waits "
                    "for the ring's last block before its GEMM starts (one hardware queue): "
                    "no overlap. Set wait_gemm: false, or more connections", op)


def flags(device: torch.device, world: int) -> torch.Tensor:
    """The process's arrival flags for a ring of `world` blocks on `device` (int32, one per
    block), made once: a replayed pass keeps its address. Passes run one at a time, and a
    pass zeroes them on its stream first."""
    key = (str(device), world)
    if key not in _flags:
        _flags[key] = torch.zeros(world, dtype=torch.int32, device=device)
    return _flags[key]


def arrival_order(device: torch.device, order: Sequence[int]) -> torch.Tensor:
    """`order` (the blocks in the order they arrive) as an int32 tensor on `device`, made
    once, outside any CUDA graph capture: one made inside it would be filled only when that
    graph replays."""
    key = (str(device), tuple(order))
    if key not in _orders:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"megatron_overlap: wait_gemm: a ring of arrival order {list(order)} first ran "
                "inside a CUDA graph capture; run the layer once eagerly before capturing "
                "(as Megatron's and this package's graphs warm up)")
        _orders[key] = torch.tensor(list(order), dtype=torch.int32, device=device)
    return _orders[key]


def set_flag(ready: torch.Tensor, block: int) -> None:
    """ready[block] = 1, ordered after the current stream's work: on a GPU a stream memory
    write (torch's symmetric-memory op: no kernel, no SM; a fence before it)."""
    if ready.device.type == "cuda":
        import torch.distributed._symmetric_memory  # noqa: F401  (registers symm_mem's ops)

        torch.ops.symm_mem.stream_write_value32_(ready.view(torch.uint32), block, 1)
    else:
        ready[block] = 1


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream that waits for the transfers and sets the flags (one per device)."""
    key = str(device)
    if key not in _side:
        _side[key] = torch.cuda.Stream(device=device)
    return _side[key]


class FlagSide:
    """Where the flags are set: on a GPU a side stream, forked from the current stream when
    the block is entered and joined back by `join`, after the GEMM is queued; on CPU the
    current thread, in order.

    Everything the side stream runs is queued before the GEMM, never after it. Seen on an
    H100: with the GEMM queued first, the flags never came (it hung, or trapped at its
    timeout). The likely cause is CUDA's lazy loading: a kernel's first launch in a process
    loads its module, which waits for the kernels running, here the GEMM spinning on the
    flag that kernel's stream would set. Under CUDA_DEVICE_MAX_CONNECTIONS=1 (one hardware
    queue) the side stream's waits then hold the GEMM back until the last block has
    landed: no overlap (`one_queue` says so)."""

    def __init__(self, device: torch.device):
        self._main = torch.cuda.current_stream(device) if device.type == "cuda" else None
        if self._main is not None:
            self._stream = side_stream(device)
            self._ctx = torch.cuda.stream(self._stream)

    def __enter__(self) -> "FlagSide":
        if self._main is not None:
            self._stream.wait_stream(self._main)
            self._ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._main is not None:
            self._ctx.__exit__(*exc)

    def join(self) -> None:
        """The current stream waits for what the side stream ran."""
        if self._main is not None:
            self._main.wait_stream(self._stream)


def launch(a: torch.Tensor, wt: torch.Tensor, out: torch.Tensor, ready: torch.Tensor,
           order: torch.Tensor, rows: int, gemm: Gemm, *, op: str, timeout_s: float,
           sm_margin: int = 0, cfg: Optional[tuple] = None, descriptors: bool = True) -> None:
    """out = a @ wt on the current stream, each block's tiles once ready[block] is set.
    `a`: [blocks * rows, K]; `order`: the blocks in arrival order; `sm_margin`: SMs held
    back beyond SM_LEFT (the layer's set_sm_margin); `cfg`: a tile config of `CONFIGS`'
    form in place of `config`'s (benchmarks/probe_chunk_wait_gemm.py's sweep);
    `descriptors`: False runs the pointer kernel where `tma` allows TMA (the probe and the
    GPU tests compare both). On CPU under TRITON_INTERPRET=1 the kernel runs in Triton's
    interpreter (the probe's check)."""
    if a.device.type != "cuda":
        missing = (ready == 0).nonzero().flatten().tolist()
        if missing:
            raise RuntimeError(f"{op}: the waiting GEMM launched with block(s) {missing} never "
                               "flagged as arrived; the schedule would hang on a GPU")
        if os.environ.get("TRITON_INTERPRET") != "1":
            gemm(a, wt, out, op=op, chunk=0)
            return
    from . import wait_gemm_triton as kernels
    from ..comm import trace

    trace.record("gemm", op, 0)
    one_queue(op)
    m, k = a.shape
    n = wt.shape[1]
    sms = (torch.cuda.get_device_properties(a.device).multi_processor_count
           if a.device.type == "cuda" else 4)
    room = max(1, sms - SM_LEFT - sm_margin)
    bm, bn, bk, warps, stages, group = cfg or config(a.dtype, rows, n, k, m, room)
    programs = min((m // bm) * (n // bn), room)
    scaled = gemm is not matmul
    sa, sb = (gemm.a_inv, gemm.b_inv) if scaled else (ready, ready)
    # FP8 without fast accumulation (`ScaledGemm.fast_accum`): the tile's products added
    # into fp32 every BLOCK_K, where Triton's default on Hopper never promotes them
    imprecise = bk if scaled and not gemm.fast_accum else None
    common = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=min(group, rows // bm),
                  SCALED=scaled, IMPRECISE=imprecise, num_warps=warps, num_stages=stages)
    timeout_ns = int(timeout_s * 1.5e9)
    if descriptors and tma(a, wt, out):
        from triton.tools.tensor_descriptor import TensorDescriptor

        b_nk = wt.stride(0) == 1  # K contiguous: described as the [N, K] weight it views
        kernels.waiting_gemm_tma[(programs,)](
            TensorDescriptor.from_tensor(a, [bm, bk]),
            TensorDescriptor.from_tensor(wt.t(), [bn, bk]) if b_nk else
            TensorDescriptor.from_tensor(wt, [bk, bn]),
            TensorDescriptor.from_tensor(out, [bm, bn]), ready, order, sa, sb, m, n, k,
            rows // bm, programs, timeout_ns, B_NK=b_nk, **common)
        return
    kernels.waiting_gemm[(programs,)](
        a, wt, out, ready, order, sa, sb, m, n, k, a.stride(0), wt.stride(0), wt.stride(1),
        out.stride(0), rows // bm, programs, timeout_ns, GPU=a.device.type == "cuda", **common)


@functools.lru_cache(maxsize=None)
def _has_tma(device: int) -> bool:
    """Compute capability 9 or more, and a Triton with host-made descriptors (3.4 on, torch
    2.8 on): asked once per device, not at every launch."""
    if torch.cuda.get_device_capability(device)[0] < 9:
        return False
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return True


def tma(a: torch.Tensor, wt: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the kernel reads and writes through TMA descriptors (`waiting_gemm_tma`): on
    a GPU of compute capability 9 or more, under a Triton with host-made descriptors, with
    every operand's base and row stride in whole 16 bytes and one of its dimensions
    contiguous (TMA's rules); else through pointers."""
    if a.device.type != "cuda" or not _has_tma(a.device.index or 0):
        return False

    def ok(t: torch.Tensor) -> bool:
        inner = 0 if t.stride(0) == 1 else 1
        return (t.stride(inner) == 1 and t.data_ptr() % 16 == 0
                and t.stride(1 - inner) * t.element_size() % 16 == 0)
    return ok(a) and ok(wt) and ok(out) and a.stride(1) == 1 and out.stride(1) == 1
