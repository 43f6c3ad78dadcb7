"""How `overlap.fp8_kernels.run` launches its Triton kernel, on CPU: which tensors go where
for each kernel (a stand-in kernel computes what the Triton one is written to, so each
kernel name's outputs must equal its eager definition in overlap.fp8), what it declines
(layouts it does not take, a per-row scale), the capture rule (a launch signature not
compiled yet never runs inside a CUDA-graph capture), and a failure (logged once, then
the caller's kernels). The Triton kernel itself, its bits against eager's: the GPU suite
(tests/gpu/test_fp8_cast_gpu.py)."""

import functools
import logging

import pytest
import torch

pytest.importorskip("torchao", reason="the [fp8] extra (torchao) is not installed")

from megatron_overlap.overlap import fp8 as f  # noqa: E402
from megatron_overlap.overlap import fp8_act  # noqa: E402
from megatron_overlap.overlap import fp8_kernels as k  # noqa: E402

E4M3 = torch.float8_e4m3fn


class StandIn:
    """Computes what `fp8_kernels`' Triton kernel `name` is written to compute, in torch."""

    def __init__(self, name, launches):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        def cast_t(x, s, o, ot, used, amax, y, m, n, na, blocks, chunks, nh, *, FMAX, CAST,
                   WRITE_T, AMAX, FROM_AMAX, T_FROM_O, CHUNK_MAJOR, NA, ACT, AMAX_ONLY, BM, BN,
                   num_warps):
            # T_FROM_O: the transposed copy from the bytes written to o (the same bytes); an
            # activation's always (its x is made in float32)
            assert T_FROM_O == (bool(ACT) or (CAST and WRITE_T and x.dtype == torch.float32))
            assert CHUNK_MAJOR == ((blocks, chunks) != (1, 1)) and m % (blocks * chunks) == 0
            self.launches.append(dict(grid=grid, m=m, n=n, CAST=CAST, WRITE_T=WRITE_T, AMAX=AMAX,
                                      FROM_AMAX=FROM_AMAX, T_FROM_O=T_FROM_O,
                                      CHUNK_MAJOR=CHUNK_MAJOR, ACT=ACT, AMAX_ONLY=AMAX_ONLY))
            if ACT:  # x made from y = [gate, up] ([m, 2 nh]); ACT 2: x_ptr is the output grad
                assert y.shape == (m, 2 * nh) and n == (nh if ACT == 1 else 2 * nh)
                x = fp8_act.swiglu(y) if ACT == 1 else fp8_act.swiglu_grad(x, y)
            assert (m, n) == tuple(x.shape) and grid == (-(-m // BM), -(-n // BN))
            assert NA >= na and NA & (NA - 1) == 0  # a power of two holding the amaxes
            if AMAX_ONLY:
                amax.copy_(torch.maximum(amax, x.float().abs().max()))
                return
            if FROM_AMAX:  # s: the amaxes; the scale made from their max, written with its inverse
                a = amax[:na].max().double().clamp(min=1e-12)
                scale = (FMAX / a).float()
                used.copy_(f.pair_of(scale, (1 / scale.double()).float()))
                s = scale
            if CAST:  # s: the scale, a pair's at SCALE_AT (delayed: AMAX), else the value
                value = s.reshape(-1)[k.SCALE_AT] if AMAX else s.reshape(-1)[0]
                q = (x.float() * value).clamp(-FMAX, FMAX).to(o.dtype)
                if CHUNK_MAJOR:  # row j of chunk i of block w to row j of block w in chunk i
                    sub = m // (blocks * chunks)
                    for w in range(blocks):
                        for i in range(chunks):
                            o[(i * blocks + w) * sub:(i * blocks + w + 1) * sub] = \
                                q[(w * chunks + i) * sub:(w * chunks + i + 1) * sub]
                else:
                    o.copy_(q)
                if AMAX:  # s: the pair it copies out
                    amax.copy_(torch.maximum(amax, x.float().abs().max()))
                    used.copy_(s)
            else:
                q = x
            if WRITE_T:
                ot.copy_(q.t())

        def amax(x, out, n, *, BLOCK, num_warps):
            self.launches.append(dict(grid=grid, n=n, kernel="amax"))
            assert n == x.numel() and grid == (-(-n // BLOCK),)
            out.copy_(torch.maximum(out, x.float().abs().max()))
        def delayed_update(h, every, s, length, world, stride, *, FMAX, DIV, USE_MAX, BL, BW,
                           num_warps):
            n = h.shape[0]
            self.launches.append(dict(grid=grid, kernel="delayed_update", warps=num_warps))
            assert grid == (n,) and (length, world) == (h.shape[1], every.shape[0])
            assert BL >= length and BW >= world and num_warps == (1 if BL <= 1024 else 4)
            a = torch.as_strided(every, (world, n), (stride, 1)).amax(0)  # (NaN kept)
            a = torch.where(a.isnan(), 0.0, a)
            h.copy_(torch.cat([h[:, 1:], a[:, None]], dim=1))
            ref = (h.amax(1) if USE_MAX else a).double()
            new = (FMAX / ref / DIV).clamp(max=torch.finfo(torch.float32).max).float()
            pair = [new, new]
            pair[k.INVERSE_AT] = (1 / new.double()).float()
            ok = ((ref > 0) & (ref < float("inf")))[:, None]
            s.copy_(torch.where(ok, torch.stack(pair, dim=1), s))
        return {"cast_t": cast_t, "amax": amax, "delayed_update": delayed_update}[self.name]


class StandIns(dict):
    def __init__(self):
        self.launches = []
        super().__init__((name, StandIn(name, self.launches))
                         for name in ("cast_t", "amax", "delayed_update"))


@pytest.fixture
def kernel(monkeypatch):
    fake = StandIns()
    monkeypatch.setattr(k, "_kernels", fake)
    monkeypatch.setattr(k, "_seen", set())
    monkeypatch.setattr(k, "_broken", set())
    return fake


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16) * 50


def test_each_kernel_s_tensors_go_where_its_eager_definition_puts_them(kernel):
    saturate = f._ao().to_fp8_saturated
    x, scale = _x(100, 72), torch.tensor(2.5)
    # cast-transpose: both layouts (a float32 x's transposed copy read back from o)
    for xd in (x, x.float()):
        got = torch.empty(100, 72, dtype=E4M3), torch.empty(72, 100, dtype=E4M3)
        want = torch.empty(100, 72, dtype=E4M3), torch.empty(72, 100, dtype=E4M3)
        assert k.run("cast_transpose", (xd, scale, *got), False)
        assert kernel.launches[-1]["T_FROM_O"] == (xd.dtype == torch.float32)
        f._cast_t_by(saturate, xd, scale, *want)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want))
    # delayed: the scale pair used, the amax (from zero), the cast, with and without the
    # transpose
    pair = f.pair_of(scale)
    for name, t in (("delayed_cast_amax", False), ("delayed_cast_amax_t", True)):
        outs = [torch.zeros(2), torch.zeros(()), torch.empty(100, 72, dtype=E4M3)]
        refs = [torch.zeros(2), torch.zeros(()), torch.empty(100, 72, dtype=E4M3)]
        if t:
            outs.append(torch.empty(72, 100, dtype=E4M3))
            refs.append(torch.empty(72, 100, dtype=E4M3))
        assert k.run(name, (x, pair, *outs), False)
        f._delayed_cast_amax_by(saturate, x, pair, *refs)
        assert torch.equal(outs[0], pair) and torch.equal(outs[1], refs[1])
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                   for a, b in zip(outs[2:], refs[2:]))
    # a 3-D input (delayed, no transpose): one [rows, last] matrix
    x3, out3 = _x(4, 25, 72), torch.empty(4, 25, 72, dtype=E4M3)
    assert k.run("delayed_cast_amax", (x3, pair, torch.zeros(2), torch.zeros(()), out3), False)
    assert kernel.launches[-1]["m"] == 100
    # the transposed copy of FP8 bytes
    q = x.to(E4M3).view(torch.uint8)
    qt = torch.empty(72, 100, dtype=torch.uint8)
    assert k.run("transpose", (q, qt), False) and torch.equal(qt, q.t())
    assert [(d["CAST"], d["WRITE_T"], d["AMAX"]) for d in kernel.launches] == [
        (True, True, False), (True, True, False), (True, False, True), (True, True, True),
        (True, False, True),
        (False, True, False)]
    # current scaling: the scale made from the amax (the max of the group's), written as a
    # pair, the cast, with and without the transpose
    to_scale = f._ao().amax_to_scale
    for amaxes in (f._amax_into(x, torch.empty(())).reshape(1), torch.tensor([3.0, 150.0, 7.0])):
        for t in (False, True):
            outs = [torch.zeros(2), torch.empty(100, 72, dtype=E4M3)]
            refs = [torch.zeros(2), torch.empty(100, 72, dtype=E4M3)]
            if t:
                outs.append(torch.empty(72, 100, dtype=E4M3))
                refs.append(torch.empty(72, 100, dtype=E4M3))
            name = "current_cast_t" if t else "current_cast"
            assert k.run(name, (x, amaxes, *outs), False)
            f._current_cast_by(to_scale, saturate, E4M3, x, amaxes, *refs)
            assert torch.equal(outs[0], refs[0]) and kernel.launches[-1]["FROM_AMAX"]
            assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                       for a, b in zip(outs[1:], refs[1:]))


@pytest.mark.parametrize("algo,margin", [("max", 0), ("most_recent", 2)])
@pytest.mark.parametrize("length", [1, 5, 2000])
def test_the_update_kernel_s_tensors_go_where_its_eager_definition_puts_them(
        kernel, algo, margin, length):
    """`delayed_update`: two histories of a block of three (rows 1-2), each rank's amaxes
    a column slice of the exchange's [world, 3] result (its row stride 3), one with a NaN
    from one rank: the same history and scale pairs as `_update_by`, one program a row,
    one warp up to 1024 amaxes."""
    h = torch.rand(3, length, generator=torch.Generator().manual_seed(5)) * 10
    s = torch.tensor([[0.5, 2.0], [0.25, 4.0], [0.125, 8.0]])
    every = torch.tensor([[1.0, 3.0, 99.0], [2.0, float("nan"), 99.0], [0.5, 1.0, 99.0],
                          [4.0, 0.0, 99.0]])[:, :2]
    got, want = (h.clone(), s.clone()), (h.clone(), s.clone())
    consts = dict(fp8_max=448.0, margin=margin, algo=algo)
    assert k.run("delayed_update", (got[0][1:], every, got[1][1:]), False, consts=consts)
    f._update_by(algo == "max", 448.0, margin, want[0][1:], every, want[1][1:])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert kernel.launches[-1] == dict(grid=(2,), kernel="delayed_update",
                                       warps=1 if length <= 1024 else 4)
    assert torch.equal(got[1][0], s[0]) and got[0][1:, -1].tolist() == [4.0, 0.0]
    # what it does not take: float64 rows, a scale block of another shape, columns strided
    assert not k.run("delayed_update", (h.double(), every, s), False, consts=consts)
    assert not k.run("delayed_update", (h, every, s[:, :1]), False, consts=consts)
    assert not k.run("delayed_update", (h, torch.rand(3, 6)[:, ::2], s), False, consts=consts)


def test_a_pass_s_histories_update_as_each_one_alone():
    """`update_scales` over a block's rows equals `update_scale` on each history alone,
    every rank's amaxes reduced first (their max; a NaN from any rank recorded as 0)."""
    every = torch.tensor([[3.0, 0.5], [7.0, float("nan")]])
    block = f.AmaxHistory(4, torch.device("cpu")), f.AmaxHistory(4, torch.device("cpu"))
    hist, scale = torch.zeros(2, 4), torch.ones(2, 2)
    rows = [f.AmaxHistory(4, torch.device("cpu"), hist[i], scale[i]) for i in range(2)]
    for step in range(5):
        f.update_scales(hist, scale, every * (step + 1), E4M3, 1, "max")
        for i, st in enumerate(block):
            a = (every * (step + 1))[:, i].amax()
            f.update_scale(st, a, E4M3, 1, "max")
            assert torch.equal(rows[i].history, st.history) and torch.equal(rows[i].scale, st.scale)
    assert rows[1].history.tolist() == [0.0] * 4 and float(f.scale_value(rows[1].scale)) == 1.0


def _same(got, want) -> bool:
    """Every pair bit-equal (FP8 as bytes: NaN bits too)."""
    as_bits = lambda t: t.view(torch.uint8) if t.element_size() == 1 else t  # noqa: E731
    return all(torch.equal(as_bits(a), as_bits(b)) for a, b in zip(got, want, strict=True))


def test_chunk_major_puts_each_pipeline_chunk_of_every_block_in_adjacent_rows():
    """`chunk_major`: rows [blocks, chunks, sub] to [chunks, blocks, sub]; chunk i of the
    result is chunk i of every block, blocks in order, each chunk's rows as they were."""
    t = torch.arange(24 * 3).view(24, 3)
    got = f.chunk_major(t, 2, 3)  # blocks of 12 rows, chunks of 4
    for i in range(3):
        for w in range(2):
            assert torch.equal(got[(i * 2 + w) * 4:(i * 2 + w + 1) * 4],
                               t[w * 12 + i * 4:w * 12 + (i + 1) * 4])
    assert torch.equal(f.chunk_major(t, 1, 1), t) and torch.equal(f.chunk_major(t, 4, 1), t)


def test_chunk_major_refuses_rows_that_do_not_split_and_non_matrices():
    with pytest.raises(ValueError, match="split into 4 blocks of 2 chunks"):
        f.chunk_major(torch.zeros(12, 3), 4, 2)
    with pytest.raises(ValueError, match="2-D"):
        f.chunk_major(torch.zeros(2, 8, 3), 2, 2)


def test_a_row_input_is_cast_chunk_major_only_for_the_flat_scattering_pipeline():
    """`row_input_chunks`, the one decision the layer, the tuner's trial pass and the cost
    model share: per-tensor scales, the flat pipeline with SP, more than one rank and
    chunk; anything else keeps x's row order."""
    one_node, two_nodes = [[0, 1, 2, 3]], [[0, 1], [2, 3]]
    assert f.row_input_chunks("tensorwise", "pipeline", True, None, 4, 2) == (4, 2)
    assert f.row_input_chunks("delayed", "pipeline", True, one_node, 4, 4) == (4, 4)
    for args in (("rowwise", "pipeline", True, None, 4, 2),  # scales in the rows
                 ("tensorwise", "ring_exchange", True, None, 4, 2),
                 ("tensorwise", "bulk", True, None, 4, 2),
                 ("tensorwise", "pipeline", False, None, 4, 2),  # an all-reduce: row order
                 ("tensorwise", "pipeline", True, two_nodes, 4, 2),  # hierarchical
                 ("tensorwise", "pipeline", True, None, 1, 2),  # the order is x's already
                 ("tensorwise", "pipeline", True, None, 4, 1)):
        assert f.row_input_chunks(*args) is None, args


@pytest.mark.parametrize("t", [False, True])
def test_a_chunk_major_cast_is_the_row_order_cast_reordered(kernel, t):
    """Current and delayed casts with `chunks`: the kernel (`CHUNK_MAJOR`) and the fallback
    where it does not run write x's cast reordered by `chunk_major`, the transposed copy
    and the scale as the row-order cast writes them."""
    saturate, to_scale = f._ao().to_fp8_saturated, f._ao().amax_to_scale
    x, amaxes, pair = _x(96, 40), torch.tensor([3.0, 150.0]), f.pair_of(torch.tensor(2.5))
    suffix, extra = ("_t", lambda: [torch.empty(40, 96, dtype=E4M3)]) if t else ("", list)
    for blocks, chunks in ((4, 3), (2, 2), (1, 4)):
        outs, refs = [torch.zeros(2), torch.empty(96, 40, dtype=E4M3), *extra()], \
            [torch.zeros(2), torch.empty(96, 40, dtype=E4M3), *extra()]
        assert k.run("current_cast" + suffix, (x, amaxes, *outs), False, (blocks, chunks))
        assert kernel.launches[-1]["CHUNK_MAJOR"]
        f._current_cast_by(to_scale, saturate, E4M3, x, amaxes, *refs)
        refs[1] = f.chunk_major(refs[1], blocks, chunks)
        assert _same(outs, refs)
        outs, refs = [torch.zeros(2), torch.zeros(()), torch.empty(96, 40, dtype=E4M3), *extra()], \
            [torch.zeros(2), torch.zeros(()), torch.empty(96, 40, dtype=E4M3), *extra()]
        assert k.run("delayed_cast_amax" + suffix, (x, pair, *outs), False, (blocks, chunks))
        f._delayed_cast_amax_by(saturate, x, pair, *refs)
        refs[2] = f.chunk_major(refs[2], blocks, chunks)
        assert _same(outs, refs)
    # rows that do not divide, the bytes-only transpose, the amax: not chunk-major
    o = torch.empty(96, 40, dtype=E4M3)
    assert not k.run("current_cast", (x, amaxes, torch.zeros(2), o), False, (5, 2))
    q = x.to(E4M3).view(torch.uint8)
    assert not k.run("transpose", (q, torch.empty(40, 96, dtype=torch.uint8)), False, (2, 2))
    assert not k.run("amax", (x, torch.empty(())), False, (2, 2))


def test_quantize_with_chunks_equals_the_row_order_quantize_reordered():
    """On CPU (no kernel): `quantize_current` and `delayed_quantize` with `chunks` cast in
    row order and reorder: x8 chunk-major, x8t, the scale pair and the amax as without."""
    x = _x(64, 24)
    a = f.amax(x)
    want = [torch.zeros(2), torch.empty(64, 24, dtype=E4M3), torch.empty(24, 64, dtype=E4M3)]
    got = [torch.zeros(2), torch.empty(64, 24, dtype=E4M3), torch.empty(24, 64, dtype=E4M3)]
    f.quantize_current(x, a, E4M3, want[0], out=want[1], out_t=want[2])
    f.quantize_current(x, a, E4M3, got[0], out=got[1], out_t=got[2], chunks=(4, 2))
    want[1] = f.chunk_major(want[1], 4, 2)
    assert _same(got, want)
    state = f.AmaxHistory(4, x.device)
    state.scale.copy_(f.pair_of(torch.tensor(3.0)))
    outs = [torch.zeros(2), torch.zeros(()), torch.empty(64, 24, dtype=E4M3)]
    refs = [torch.zeros(2), torch.zeros(()), torch.empty(64, 24, dtype=E4M3)]
    f.delayed_quantize(x, state, E4M3, refs[0], refs[1], out=refs[2])
    f.delayed_quantize(x, state, E4M3, outs[0], outs[1], out=outs[2], chunks=(2, 4))
    refs[2] = f.chunk_major(refs[2], 2, 4)
    assert _same(outs, refs)


def test_the_amax_kernel_is_torch_s_amax_from_zero(kernel):
    """'amax': max |x| over the flat tensor, into a scalar the launch zeroes first (what
    was there before does not count), as `overlap.fp8`'s eager amax."""
    for x in (_x(100, 72), _x(3, 5, 7), -_x(8193), torch.zeros(40, dtype=torch.bfloat16)):
        out = torch.full((), 1e30)
        assert k.run("amax", (x, out), False)
        assert torch.equal(out, f._amax_into(x, torch.empty(())))
        assert kernel.launches[-1]["grid"] == (-(-x.numel() // k.AMAX_BLOCK[0]),)
    nan = _x(64, 32)
    nan[7, 3] = float("nan")
    out = torch.empty(())
    assert k.run("amax", (nan, out), False) and out.isnan()


def test_layouts_it_does_not_take_run_the_callers_kernels(kernel):
    x, scale = _x(64, 32), torch.tensor(1.0)
    o, ot = torch.empty(64, 32, dtype=E4M3), torch.empty(32, 64, dtype=E4M3)
    assert not k.run("cast_transpose", (x.t(), scale, o.t(), ot.t()), False)  # a view
    assert not k.run("cast_transpose", (x, torch.ones(64, 1), o, ot), False)  # per-row scales
    assert not k.run("cast_transpose", (x, scale, o, torch.empty(64, 32, dtype=E4M3)), False)
    assert not k.run("transpose", (o.view(torch.uint8).t(), ot.view(torch.uint8)), False)
    # shapes the eager definitions refuse (the kernel would write past its outputs)
    assert not k.run("transpose", (o.view(torch.uint8), ot.view(torch.uint8)[:, :63]), False)
    assert not k.run("cast_transpose", (x, scale, o[:63], ot), False)
    pair = torch.ones(2)
    assert not k.run("delayed_cast_amax", (x, pair, torch.zeros(2),
                                           torch.zeros((), dtype=torch.bfloat16), o), False)
    # delayed's scale and the copy it writes are pairs (a lone value would be overrun)
    assert not k.run("delayed_cast_amax", (x, scale, torch.zeros(2), torch.zeros(()), o), False)
    assert not k.run("delayed_cast_amax", (x, pair, torch.zeros(()), torch.zeros(()), o), False)
    assert not k.run("cast_transpose", (x[:0], scale, o[:0], ot[:, :0]), False)  # nothing to do
    wide = torch.zeros(1, k.MAX_GRID_Y * k.BLOCK[1] + 1, dtype=torch.bfloat16)  # too many tiles
    assert not k.run("delayed_cast_amax", (wide, pair, torch.zeros(2), torch.zeros(()),
                                           torch.empty(wide.shape, dtype=E4M3)), False)
    # current: fp32 amaxes in a vector (a 0-d one is the caller's to flatten), a pair out
    assert not k.run("current_cast", (x, torch.tensor(2.0), pair, o), False)
    assert not k.run("current_cast", (x, torch.ones(2, dtype=torch.float64), pair, o), False)
    assert not k.run("current_cast", (x, torch.ones(1), torch.ones(()), o), False)
    assert not k.run("current_cast", (x, torch.ones(k.MAX_AMAXES + 1), pair, o), False)
    assert not k.run("current_cast", (x, torch.ones(1, device="meta"), pair, o), False)
    # the amax: contiguous floating-point values, something to read, a float32 scalar out
    assert not k.run("amax", (x.t(), torch.empty(())), False)
    assert not k.run("amax", (x[:0], torch.empty(())), False)
    assert not k.run("amax", (x.view(torch.int16), torch.empty(())), False)
    assert not k.run("amax", (x, torch.empty((), dtype=torch.float64)), False)
    assert not kernel.launches


def test_a_capture_never_compiles_a_new_launch_signature(kernel):
    """Inside a capture only a signature launched before runs (a Triton compile there could
    break it); dtypes, the kernel's flags, each pointer's 16-byte alignment and each size's
    divisibility by 16 (and being 1) make it, as they make Triton's variants."""
    x, scale = _x(64, 32), torch.tensor(1.0)
    o, ot = torch.empty(64, 32, dtype=E4M3), torch.empty(32, 64, dtype=E4M3)
    assert not k.run("cast_transpose", (x, scale, o, ot), True)
    assert k.run("cast_transpose", (x, scale, o, ot), False)
    assert k.run("cast_transpose", (x, scale, o, ot), True)
    assert not k.run("cast_transpose", (x.float(), scale, o, ot), True)  # another dtype
    odd = torch.empty(64 * 32 + 1, dtype=torch.uint8)[1:].view(E4M3).view(64, 32)
    assert not k.run("cast_transpose", (x, scale, odd, ot), True)  # another alignment
    x2, o2, ot2 = _x(64, 40), torch.empty(64, 40, dtype=E4M3), torch.empty(40, 64, dtype=E4M3)
    assert not k.run("cast_transpose", (x2, scale, o2, ot2), True)  # a size not 16-divisible
    assert k.run("cast_transpose", (_x(48, 32), scale, o[:48], ot[:, :48].contiguous()), True)
    assert len(kernel.launches) == 3  # (48 x 32: the same variant as 64 x 32)
    a = torch.empty(())
    assert not k.run("amax", (x, a), True)  # each kernel its own signatures
    assert k.run("amax", (x, a), False) and k.run("amax", (_x(96, 32), a), True)
    assert not k.run("amax", (_x(95), a), True)


def test_a_failing_kernel_is_logged_once_and_not_tried_again(monkeypatch, caplog):
    monkeypatch.setattr(k, "_seen", set())
    monkeypatch.setattr(k, "_broken", set())
    monkeypatch.setattr(k, "_kernels", None)
    calls = []

    def broken():
        calls.append(1)
        raise RuntimeError("no Triton here")
    monkeypatch.setattr(k, "_make", broken)
    x, scale = _x(64, 32), torch.tensor(1.0)
    args = (x, scale, torch.empty(64, 32, dtype=E4M3), torch.empty(32, 64, dtype=E4M3))
    with caplog.at_level(logging.WARNING, logger="megatron_overlap"):
        assert not k.run("cast_transpose", args, False)
        assert not k.run("cast_transpose", args, False)
    assert len(calls) == 1 and k._broken == set(k.EVERY)  # no Triton: none tried again
    assert sum("its Triton kernel failed" in r.message for r in caplog.records) == 1


def test_a_failure_inside_a_capture_is_raised(monkeypatch, kernel):
    """A launch whose signature ran before cannot compile, so a failure there is the
    kernel's: raised, not hidden inside a capture (which it would leave broken)."""
    x, scale = _x(64, 32), torch.tensor(1.0)
    args = (x, scale, torch.empty(64, 32, dtype=E4M3), torch.empty(32, 64, dtype=E4M3))
    assert k.run("cast_transpose", args, False)

    class Failing:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                raise RuntimeError("launch failed")
            return launch
    monkeypatch.setattr(k, "_kernels", {"cast_t": Failing(), "amax": Failing()})
    with pytest.raises(RuntimeError, match="launch failed"):
        k.run("cast_transpose", args, True)
    assert not k.run("cast_transpose", args, False)  # outside: logged, that kernel left
    assert k._broken == {"cast_transpose"}


def test_quantize_on_cpu_never_reaches_the_kernels(kernel):
    """On CPU (and with set_fused(False)) `quantize` and `delayed_quantize` run their eager
    definitions: the same bits, no launch."""
    x, scale = _x(64, 32), torch.tensor(1.0)
    out_t = torch.empty(32, 64, dtype=E4M3)
    got = f.quantize(x, scale, E4M3, out_t=out_t)
    want = functools.partial(f._cast_by, f._ao().to_fp8_saturated)(
        x, scale, torch.empty(64, 32, dtype=E4M3))
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(out_t.view(torch.uint8), want.view(torch.uint8).t())
    st, used, a = f.AmaxHistory(2, x.device), f.scale_pair("cpu"), torch.empty(())
    f.delayed_quantize(x, st, E4M3, used, a)
    assert torch.equal(used, st.scale) and a == x.float().abs().max()
    assert f.amax(x) == a and not kernel.launches
    group, pair = torch.stack((a * 2, a)), f.scale_pair("cpu")
    got = f.quantize_current(x, group, E4M3, pair, out_t=out_t)
    s = f.scale_for(a * 2, E4M3)
    assert torch.equal(pair, s) and not kernel.launches  # the group's max, with its inverse
    assert torch.equal(got.view(torch.uint8), f.quantize(x, s, E4M3).view(torch.uint8))
    assert torch.equal(out_t.view(torch.uint8), got.view(torch.uint8).t())


def test_a_scaled_gemm_refuses_an_inverse_cublaslt_cannot_take():
    """cuBLASLt refuses a scale pointer off a 16-byte boundary (CUBLAS_STATUS_NOT_SUPPORTED,
    seen on an H100 with the inverse 4 bytes into a pair); a CPU takes any address, so the
    check runs on every device. A pair keeps its inverse first, at its allocation's start."""
    pair = f.pair_of(torch.tensor(4.0))
    assert pair.shape == f.PAIR and pair.data_ptr() % 16 == 0
    assert f.scale_inverse(pair).data_ptr() == pair.data_ptr()
    assert float(f.scale_value(pair)) == 4.0 and float(f.scale_inverse(pair)) == 0.25
    f.ScaledGemm(pair, pair, torch.bfloat16, fast_accum=False)  # fine
    off = torch.tensor([0.0, 0.25, 4.0])[1:]  # a pair 4 bytes into its storage
    with pytest.raises(ValueError, match="ScaledGemm: the inverse of scale b lies 4 bytes .*"
                                         "cuBLASLt refuses"):
        f.ScaledGemm(pair, off, torch.bfloat16, fast_accum=False)


@pytest.mark.parametrize("act,chunks", [("swiglu", (1, 1)), ("swiglu", (2, 4)),
                                        ("swiglu_grad", (1, 1))])
@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
def test_the_swiglu_casts_launch_one_kernel_each_with_the_eager_bytes(kernel, act, chunks,
                                                                      delayed):
    """`fp8_kernels.run_act` (what overlap.fp8_act runs on a GPU) gives the bytes of
    overlap.fp8_act's eager path: current scaling an amax launch (writing nothing) and a
    cast, delayed one cast that reduces its amax; rows chunk-major, the transposed copy."""
    gen = torch.Generator().manual_seed(5)
    y = (torch.randn(64, 512, generator=gen) * 3).bfloat16()  # (nh 256: two column tiles)
    g = torch.randn(64, 256, generator=gen).bfloat16() if act == "swiglu_grad" else None
    n = 256 if act == "swiglu" else 512
    fp8 = E4M3 if act == "swiglu" else torch.float8_e5m2
    state = None
    if delayed:
        state = f.AmaxHistory(4, torch.device("cpu"))
        state.scale.copy_(f.pair_of(torch.tensor(4.0)))

    def outs():
        return (torch.empty(64, n, dtype=fp8), torch.empty(n, 64, dtype=fp8), f.scale_pair("cpu"),
                torch.empty((), dtype=torch.float32))
    o, ot, pair, amax = outs()
    kw = dict(o=o, ot=ot, used=pair, chunks=chunks)
    if delayed:
        assert k.run_act(act, "delayed", False, y, g, amax, scale=state.scale, **kw)
    else:
        assert k.run_act(act, "amax", False, y, g, amax)
        assert k.run_act(act, "current", False, y, g, amax, **kw)
    modes = [(x["ACT"], x["AMAX_ONLY"], x["CHUNK_MAJOR"]) for x in kernel.launches]
    want_act = 1 if act == "swiglu" else 2
    assert modes == ([(want_act, False, chunks != (1, 1))] if delayed else
                     [(want_act, True, False), (want_act, False, chunks != (1, 1))])
    eo, eot, epair, eamax = outs()
    fp8_act.quantized(act, y, g, fp8, epair, eo, eot, None if chunks == (1, 1) else chunks,
                      state, eamax)
    for a, b in ((o, eo), (ot, eot), (pair, epair), (amax, eamax)):
        assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                           b.view(torch.uint8) if b.element_size() == 1 else b)
    # what it declines: an odd width, a gradient of another shape; a gradient's tiles are
    # as wide as divides its halves (each tile in one half), none where 16 does not
    assert k.act_launch(act, "amax", y[:, :95].contiguous(), g, amax) is None
    if g is not None:
        assert k.act_launch(act, "amax", y, g[:32], amax) is None
        for nh, bn in ((96, 32), (80, 16), (2752, 64)):
            yy = torch.zeros(64, 2 * nh, dtype=y.dtype)
            got = k.act_launch(act, "amax", yy, torch.zeros(64, nh, dtype=y.dtype), amax)
            assert got.flags["BN"] == bn and got.grid == (1, 2 * nh // bn), (nh, got.flags)
        assert k.act_launch(act, "amax", y[:, :200].contiguous(), g[:, :100].contiguous(),
                            amax) is None
