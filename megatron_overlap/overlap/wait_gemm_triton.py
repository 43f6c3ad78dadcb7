"""The Triton kernel of overlap/wait_gemm.py (which says what it is for, decides where it
runs and launches it). Imported there at the first launch: this module imports Triton,
which the runtime does not need."""

import triton
import triton.language as tl


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
def _pause():
    """Sleep ~a few hundred ns between polls: a spinning tile then costs the memory system
    next to nothing (every waiting tile polls one flag)."""
    return tl.inline_asm_elementwise("nanosleep.u32 256; mov.u32 $0, 0;", "=r", [],
                                     dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _wait(ready, block, timeout_ns, GPU: tl.constexpr):
    """Until ready[block] != 0: on a GPU, volatile loads with a pause between them, trapping
    once timeout_ns have passed, then one acquire (the block's bytes, written before the
    flag, are visible after it). Triton's CPU interpreter has no timer and no sleep: there
    every flag is set before the launch, and the acquire alone runs."""
    if GPU:
        deadline = _now() + timeout_ns
        while tl.load(ready + block, volatile=True) == 0:
            _pause()
            if _now() > deadline:
                _trap(block)
    while tl.atomic_add(ready + block, 0, sem="acquire") == 0:
        pass


@triton.jit
def waiting_gemm(a, b, c, ready, order, sa, sb, M, N, K, stride_am, stride_bk, stride_bn,
                 stride_cm, tiles_per_block, programs, timeout_ns,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, SCALED: tl.constexpr, GPU: tl.constexpr):
    """c = a @ b (* sa * sb): a [M, K] (rows contiguous), b [K, N] (any strides), c [M, N].
    M is row blocks of tiles_per_block * BLOCK_M rows; order[i] is the block that arrives
    i-th. Persistent: program p takes tiles p, p + programs, ... in arrival order (GROUP_M
    row tiles swept together across N, for L2 reuse of b), and before a tile reads its rows
    it waits for its block's flag."""
    pid = tl.program_id(0)
    tiles_m = M // BLOCK_M
    tiles_n = N // BLOCK_N
    per_group = GROUP_M * tiles_n
    for tile in range(pid, tiles_m * tiles_n, programs):
        first = (tile // per_group) * GROUP_M
        size_m = min(tiles_m - first, GROUP_M)
        lm = first + (tile % per_group) % size_m  # row tile in arrival order
        pn = (tile % per_group) // size_m
        block = tl.load(order + lm // tiles_per_block)
        pm = block * tiles_per_block + lm % tiles_per_block
        _wait(ready, block, timeout_ns, GPU)
        rm = pm * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        pa = a + rm[:, None] * stride_am + rk[None, :]
        pb = b + rk[:, None] * stride_bk + rn[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, K // BLOCK_K):
            acc = tl.dot(tl.load(pa), tl.load(pb), acc)
            pa += BLOCK_K
            pb += BLOCK_K * stride_bk
        if SCALED:
            acc = acc * (tl.load(sa) * tl.load(sb))
        tl.store(c + rm[:, None] * stride_cm + rn[None, :], acc.to(c.dtype.element_ty))
