"""The Triton kernels of overlap/wait_gemm.py (which says what they are for, decides where
they run and launches them). Imported there at the first launch: this module imports
Triton, which the runtime does not need.

Two kernels, one tile order and one wait: `waiting_gemm_tma` reads its operands through
TMA descriptors (Hopper and later: the copy engine of each SM streams tiles into shared
memory, as cuBLAS's Hopper GEMMs do); `waiting_gemm` through pointers (older GPUs, and
Triton's CPU interpreter for the tests). IMPRECISE: `tl.dot`'s max_num_imprecise_acc,
None (Triton's default: FP8 on Hopper accumulates in the tensor cores' own accumulator,
cuBLAS's fast accumulation) or BLOCK_K (each tile-step's products added into fp32: the
GEMMs the layer runs without fast accumulation, `wait_gemm.launch`)."""

import triton
import triton.language as tl

PAUSE_FIRST = tl.constexpr(128)  # a waiting tile's first sleep between polls, in ns,
PAUSE_MAX = tl.constexpr(2048)   # doubled up to this


@triton.jit
def _now():
    """The GPU's global timer, in ns."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)


@triton.jit
def _trap(x):
    """Abort the kernel: a CUDA error on the host, as torch's symmetric-memory waits do."""
    return tl.inline_asm_elementwise("trap; mov.u32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _pause(ns):
    """Sleep about `ns` ns (nanosleep: up to twice that)."""
    return tl.inline_asm_elementwise("nanosleep.u32 $1; mov.u32 $0, 0;", "=r,r", [ns],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _fence_async():
    """Order what this thread saw before (the flag's acquire) before its later TMA reads,
    which go through the async proxy."""
    return tl.inline_asm_elementwise("fence.proxy.async.global; mov.u32 $0, 0;", "=r", [],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait(ready, block, timeout_ns, GPU: tl.constexpr):
    """Until ready[block] != 0: on a GPU, volatile loads with a growing sleep between them,
    trapping once timeout_ns have passed, then one acquire (the block's bytes, written
    before the flag, are visible after it). Every warp of every waiting tile polls the same
    word, so the sleep doubles from PAUSE_FIRST to PAUSE_MAX: with a fixed 256 ns one, the
    copy-engine transfers beside 99 waiting tiles of 8 warps ran up to 25 times slower on
    an H100, likely from those polls (docs/results.md). Triton's CPU interpreter has no
    timer and no sleep: there every flag is set before the launch, and the acquire alone
    runs."""
    if GPU:
        deadline = _now() + timeout_ns
        ns = tl.full([], PAUSE_FIRST, tl.int32)
        while tl.load(ready + block, volatile=True) == 0:
            _pause(ns)
            ns = tl.minimum(ns * 2, PAUSE_MAX)
            if _now() > deadline:
                _trap(block)
    while tl.atomic_add(ready + block, 0, sem="acquire") == 0:
        pass


@triton.jit
def _tile(tile, order, tiles_m, tiles_n, tiles_per_block, GROUP_M: tl.constexpr):
    """The `tile`-th tile in arrival order: (its block, row tile, column tile). GROUP_M row
    tiles are swept together across N (for L2 reuse of b); row tiles follow `order`, the
    blocks in the order they arrive."""
    per_group = GROUP_M * tiles_n
    first = (tile // per_group) * GROUP_M
    size_m = min(tiles_m - first, GROUP_M)
    lm = first + (tile % per_group) % size_m  # row tile in arrival order
    block = tl.load(order + lm // tiles_per_block)
    return block, block * tiles_per_block + lm % tiles_per_block, (tile % per_group) // size_m


@triton.jit
def waiting_gemm_tma(a, b, c, ready, order, sa, sb, M, N, K, tiles_per_block, programs,
                     timeout_ns, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SCALED: tl.constexpr,
                     B_NK: tl.constexpr, IMPRECISE: tl.constexpr = None):
    """c = a @ b (* sa * sb), every operand a TMA descriptor: a [M, K], c [M, N], b [N, K]
    (B_NK: K contiguous, as a linear's weight) or [K, N]. M is row blocks of
    tiles_per_block * BLOCK_M rows; order[i] is the block that arrives i-th. Persistent:
    program p takes tiles p, p + programs, ... in arrival order (`_tile`), and before a
    tile reads its rows it waits for its block's flag."""
    pid = tl.program_id(0)
    tiles_m = M // BLOCK_M
    tiles_n = N // BLOCK_N
    for tile in range(pid, tiles_m * tiles_n, programs):
        block, pm, pn = _tile(tile, order, tiles_m, tiles_n, tiles_per_block, GROUP_M)
        _wait(ready, block, timeout_ns, True)
        _fence_async()
        om = pm * BLOCK_M
        on = pn * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            if B_NK:
                acc = tl.dot(a.load([om, k]), b.load([on, k]).T, acc,
                             max_num_imprecise_acc=IMPRECISE)
            else:
                acc = tl.dot(a.load([om, k]), b.load([k, on]), acc,
                             max_num_imprecise_acc=IMPRECISE)
        if SCALED:
            acc = acc * (tl.load(sa) * tl.load(sb))
        c.store([om, on], acc.to(c.dtype))


@triton.jit
def waiting_gemm(a, b, c, ready, order, sa, sb, M, N, K, stride_am, stride_bk, stride_bn,
                 stride_cm, tiles_per_block, programs, timeout_ns,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, SCALED: tl.constexpr, GPU: tl.constexpr,
                 IMPRECISE: tl.constexpr = None):
    """`waiting_gemm_tma` through pointers: a [M, K] (rows contiguous), b [K, N] (any
    strides), c [M, N] (rows contiguous)."""
    pid = tl.program_id(0)
    tiles_m = M // BLOCK_M
    tiles_n = N // BLOCK_N
    for tile in range(pid, tiles_m * tiles_n, programs):
        block, pm, pn = _tile(tile, order, tiles_m, tiles_n, tiles_per_block, GROUP_M)
        _wait(ready, block, timeout_ns, GPU)
        rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        pa = a + rm[:, None] * stride_am + rk[None, :]
        pb = b + rk[:, None] * stride_bk + rn[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, K // BLOCK_K):
            acc = tl.dot(tl.load(pa), tl.load(pb), acc, max_num_imprecise_acc=IMPRECISE)
            pa += BLOCK_K
            pb += BLOCK_K * stride_bk
        if SCALED:
            acc = acc * (tl.load(sa) * tl.load(sb))
        tl.store(c + rm[:, None] * stride_cm + rn[None, :], acc.to(c.dtype.element_ty))
