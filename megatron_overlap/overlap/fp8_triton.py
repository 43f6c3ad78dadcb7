"""The Triton kernels of overlap/fp8_kernels.py (which says what each computes, launches
them and decides where they run). Imported only there, at the first launch: this module
imports Triton, which the runtime does not need."""

import triton
import triton.language as tl

from . import fp8_kernels

# where a scale pair keeps its inverse and its scale (fp8_kernels.PAIR)
INVERSE_AT = tl.constexpr(fp8_kernels.INVERSE_AT)
SCALE_AT = tl.constexpr(fp8_kernels.SCALE_AT)
F32_MAX = tl.constexpr(3.4028234663852886e38)  # float32's largest value


# NaN-keeping max and clamp as selects, not tl.maximum / tl.minimum with
# propagate_nan=ALL (triton-lang/triton#11111: values made by those and stored transposed
# came out corrupted on sm90).
@triton.jit
def max_nan(a, b):
    """max that keeps a NaN (tl.maximum's default drops it)."""
    return tl.where((a > b) | (a != a), a, b)


@triton.jit
def clamp_nan(y, lo, hi):
    """y clamped to [lo, hi], a NaN kept (comparisons with it are false)."""
    return tl.where(y < lo, lo, tl.where(y > hi, hi, y))


@triton.jit
def amax_into(x, amax_ptr):
    """max |x| of a float32 block into the float32 at amax_ptr: an integer max of the
    bits with the sign bit cleared (|x| orders as its bits; a NaN, above inf, wins
    whatever its sign), in the block as across blocks (the atomic): tl.max of integers, a
    native reduction, where a float max that keeps NaN needs a combine function of its own
    (`max_nan`). Bit for bit the same; no faster on an H100 (benchmarks/probe_cast_t.py)."""
    top = tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=None)
    tl.atomic_max(amax_ptr.to(tl.pointer_type(tl.int32)), top)


@triton.jit
def scale_from(amax_ptr, na, FMAX: tl.constexpr, NA: tl.constexpr):
    """torchao's amax_to_scale of the max of the `na` amaxes at amax_ptr (NaN kept):
    fp8 max / max(amax, 1e-12), divided in fp64, rounded to fp32. (The clamp is taken in
    fp32, at fp32(1e-12): no fp32 amax lies between the two bounds, and fp8 max over
    either rounds to the same fp32 scale.)"""
    i = tl.arange(0, NA)
    a = tl.reduce(tl.load(amax_ptr + i, mask=i < na, other=0.0), 0, max_nan)
    a = tl.where(a < 1e-12, 1e-12, a).to(tl.float64)
    return (FMAX / a).to(tl.float32)


@triton.jit
def chunk_major_row(r, m, blocks, chunks):
    """Where row r of [m, n] goes in its chunk-major layout (overlap.fp8.chunk_major):
    row j of chunk i of block w ([blocks, chunks, m / (blocks * chunks)] rows) to row
    j of block w within chunk i ([chunks, blocks, ...])."""
    sub = m // (blocks * chunks)
    return ((r // sub) % chunks * blocks + r // (sub * chunks)) * sub + r % sub


@triton.jit
def swiglu_tile(g_ptr, y_ptr, rm, rn, first, mask, nh, ACT: tl.constexpr):
    """A [BM, BN] tile of a SwiGLU's output (ACT 1: silu(gate) * up, columns of [m, nh]) or
    input gradient (ACT 2: [d gate, d up], columns of [m, 2 nh], from the output gradient
    g [m, nh]), in float32 from y = [gate, up] ([m, 2 nh]): overlap.fp8_act's eager
    definition (Megatron's swiglu and swiglu_back), term for term. ACT 2: a tile lies in one
    half (the launch picks a BN that divides nh; `first`: its first column), so its columns are
    one contiguous run of y's and g's, offset by a scalar (vectorized loads, where a select
    per column was not)."""
    lo = first < nh  # (ACT 2) d gate's half, else d up's
    if ACT == 1:
        col = rn
    else:
        col = rn - tl.where(lo, 0, nh)
    at = rm[:, None].to(tl.int64) * (2 * nh) + col[None, :]
    gate = tl.load(y_ptr + at, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(y_ptr + at + nh, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    if ACT == 1:
        x = gate * sig * up
    else:
        g = tl.load(g_ptr + rm[:, None].to(tl.int64) * nh + col[None, :], mask=mask,
                    other=0.0).to(tl.float32)
        x = tl.where(lo, g * sig * (1.0 + gate * (1.0 - sig)) * up, g * (gate * sig))
    return x


@triton.jit  # (m, n specialized as Triton does: 16-divisible rows vectorize its accesses)
def cast_t(x_ptr, s_ptr, o_ptr, ot_ptr, used_ptr, amax_ptr, y_ptr, m, n, na, blocks, chunks,
           nh, FMAX: tl.constexpr, CAST: tl.constexpr, WRITE_T: tl.constexpr,
           AMAX: tl.constexpr, FROM_AMAX: tl.constexpr, T_FROM_O: tl.constexpr,
           CHUNK_MAJOR: tl.constexpr, NA: tl.constexpr, ACT: tl.constexpr,
           AMAX_ONLY: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):
    """One [BM, BN] tile of x [m, n]: with CAST, saturate(fp32(x) * scale) into o and,
    with WRITE_T, transposed into ot; the scale read at s_ptr, or with FROM_AMAX made
    from the `na` amaxes at amax_ptr (current scaling: the TP group's) and written with
    its inverse into the pair at used; with AMAX (s_ptr a scale pair) max |x| into amax
    and the pair into used; without CAST, x's bytes transposed into ot. T_FROM_O: the
    transposed copy made from the tile's bytes just written to o (read back), not from
    the values in registers. CHUNK_MAJOR: o's rows in the chunk-major order of `blocks`
    x `chunks` (`chunk_major_row`); ot keeps x's order. ACT: x is not read but made from
    y [m, 2 nh], a SwiGLU's input (gate, then up): ACT 1 its output, x [m, nh]; ACT 2 its
    input gradient, x [m, 2 nh], from x_ptr, the output gradient [m, nh] (`swiglu_tile`).
    AMAX_ONLY: max |x| into amax, nothing written (current scaling's amax of a made x)."""
    pm, pn = tl.program_id(0), tl.program_id(1)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    mask = (rm[:, None] < m) & (rn[None, :] < n)
    offs = rm[:, None].to(tl.int64) * n + rn[None, :]
    if CHUNK_MAJOR:
        offs_o = chunk_major_row(rm, m, blocks, chunks)[:, None].to(tl.int64) * n + rn[None, :]
    else:
        offs_o = offs
    if CAST:
        if ACT == 0:
            x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            x = swiglu_tile(x_ptr, y_ptr, rm, rn, pn * BN, mask, nh, ACT)
    if AMAX_ONLY:
        amax_into(x, amax_ptr)
    elif CAST:
        if FROM_AMAX:
            s = scale_from(amax_ptr, na, FMAX, NA)
            if (pm == 0) & (pn == 0):
                pair = tl.arange(0, 2)
                inv = (1.0 / s.to(tl.float64)).to(tl.float32)
                tl.store(used_ptr + pair, tl.where(pair == INVERSE_AT, inv, s))
        elif AMAX:
            s = tl.load(s_ptr + SCALE_AT)
        else:
            s = tl.load(s_ptr)
        q = clamp_nan(x * s, -FMAX, FMAX).to(o_ptr.dtype.element_ty)
        tl.store(o_ptr + offs_o, q, mask=mask)
        if AMAX:
            amax_into(x, amax_ptr)
            if (pm == 0) & (pn == 0):
                pair = tl.arange(0, 2)
                tl.store(used_ptr + pair, tl.load(s_ptr + pair))
    if WRITE_T and not AMAX_ONLY:
        if T_FROM_O:
            # With a float32 x, the tile transposed from its registers came out with whole
            # rows of the transposed copy unwritten on an H100 (rows 1, 5, 9, ... of each
            # tile; tl.trans of the FP8 tile or of the float32 one alike): its bytes are
            # read back from o instead (this block's own stores, visible after the barrier),
            # which gives them a byte load's layout, as the bytes-only transpose has.
            tl.debug_barrier()
            q = tl.load(o_ptr.to(tl.pointer_type(tl.uint8)) + offs_o, mask=mask)
        elif not CAST:
            q = tl.load(x_ptr.to(tl.pointer_type(tl.uint8)) + offs, mask=mask)
        else:
            q = q.to(tl.uint8, bitcast=True)
        mask_t = (rn[:, None] < n) & (rm[None, :] < m)
        offs_t = rn[:, None].to(tl.int64) * m + rm[None, :]
        tl.store(ot_ptr.to(tl.pointer_type(tl.uint8)) + offs_t, tl.trans(q), mask=mask_t)


@triton.jit  # (n specialized as Triton does)
def fp8_amax(x_ptr, amax_ptr, n, BLOCK: tl.constexpr):
    """max |x| of BLOCK elements of flat x [n] into the float32 at amax_ptr."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    amax_into(tl.load(x_ptr + offs, mask=offs < n, other=0.0).to(tl.float32), amax_ptr)


@triton.jit
def delayed_update(h_ptr, every_ptr, s_ptr, length, world, every_stride, FMAX: tl.constexpr,
                   DIV: tl.constexpr, USE_MAX: tl.constexpr, BL: tl.constexpr,
                   BW: tl.constexpr):
    """overlap.fp8._update_by for row `program_id` of n histories ([n, length], each row's
    scale pair at s_ptr + 2 * row): the new amax the max over the `world` ranks' (column
    `row` of every [world, every_stride]), NaN kept there and then recorded as 0; the
    history shifted one place, the amax last; the scale from the window's max (USE_MAX)
    or the new amax, in fp64, divided by DIV (2^margin), at most float32's largest; kept
    where that amax is 0 or not finite. One program reads its whole row before any of it
    is written (the barrier): a program's warps shift across each other's elements."""
    row = tl.program_id(0)
    w = tl.arange(0, BW)
    a = tl.reduce(tl.load(every_ptr + w * every_stride + row, mask=w < world, other=0.0),
                  0, max_nan)
    a = tl.where(a != a, 0.0, a)
    i = tl.arange(0, BL)
    base = h_ptr + row.to(tl.int64) * length
    h = tl.where(i == length - 1, a, tl.load(base + i + 1, mask=i + 1 < length, other=0.0))
    tl.debug_barrier()
    tl.store(base + i, h, mask=i < length)
    if USE_MAX:
        # the window's max as a signed integer max of the bits, a native reduction (the
        # combine of `max_nan` took twice as long): non-negative floats order as their
        # bits, negative ones below them (out of order among themselves, but a max <= 0
        # keeps the scale whichever it is); a NaN a checkpoint brought into the history
        # is made the largest integer, a NaN, and kept, as torch's amax keeps it: the
        # scale stays
        bits = tl.where(h != h, 0x7FFFFFFF, h.to(tl.int32, bitcast=True))
        ref = tl.max(tl.where(i < length, bits, 0), 0).to(tl.float32, bitcast=True)
    else:
        ref = a
    ref = ref.to(tl.float64)
    new = FMAX / ref / DIV
    new = tl.where(new > F32_MAX, F32_MAX, new).to(tl.float32)
    inv = (1.0 / new.to(tl.float64)).to(tl.float32)
    pair = tl.arange(0, 2)
    old = tl.load(s_ptr + 2 * row + pair)
    ok = (ref > 0) & (ref <= F32_MAX)  # (ref is a float32's value: finite, at most its max)
    tl.store(s_ptr + 2 * row + pair, tl.where(ok, tl.where(pair == INVERSE_AT, inv, new), old))
