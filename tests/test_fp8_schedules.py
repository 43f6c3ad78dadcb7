"""FP8 through the schedules, unchanged: the FP8 GEMM (`overlap.fp8.ScaledGemm`) plugs
into the GEMM seam, the transports move FP8 chunks (gloo as uint8), and every
AG->GEMM schedule (ring, aggregated ring, bulk, hierarchical) and GEMM->RS schedule
(pipeline, ring, bulk, hierarchical; reduce-scatter and all-reduce) is checked on TP 2
and 4 against the independent reference of helpers/fp8_ref.py.

Bounds, and why:
- AG->GEMM output: bit-equal. The input's scale is the TP group's amax (exchanged
  through the transport), so the gathered FP8 tensor is the whole tensor quantized
  once, and each output row of a chunk GEMM is that row of the whole-tensor GEMM (the
  CPU's _scaled_mm computes rows independently; asserted, not assumed).
- GEMM->RS, fp32 output: each rank's partial product is bit-equal to the reference's
  (same FP8 operands, same GEMM); only the sum over ranks runs in another order: at most
  world - 1 fp32 roundings (2^-24 each), so 1e-6 relative (norm) is generous.
- GEMM->RS, bf16 output: the partials are rounded to bf16 as the reference's are, and
  the reference sums them in fp64; ours adds them in bf16 (gloo's reduce-scatter, in the
  pipeline and bulk) or fp32 (the ring's and the hierarchical order's sums, the
  symmetric-memory transports) and rounds the result to bf16: at most world roundings
  (world - 1 additions, the last rounding) of 2^-9 each, so world * 2^-9 relative (norm).
- Bytes: an FP8 gather moves exactly half the bytes of the same gather in bf16.
"""

import functools

import pytest

from helpers import dist
from helpers.fp8_schedule_cases import AG, K, N, ROWS, RS, TP_SIZES, _nodes  # noqa: F401


def _cases(rank, world):
    import torch
    import torch.distributed as tdist

    from helpers import fp8_ref as ref
    from megatron_overlap.comm import ContractError, TorchP2PTransport, stats
    from megatron_overlap.overlap import all_gather_matmul, matmul, matmul_reduce_scatter
    from megatron_overlap.overlap import fp8

    tdist.init_process_group("gloo", rank=rank, world_size=world)
    tp = TorchP2PTransport(tdist.group.WORLD)
    g = torch.Generator().manual_seed(1)
    x_full = torch.randn(world * ROWS, K, generator=g) * 3
    w = torch.randn(N, K, generator=g)
    x_local = x_full[rank * ROWS:(rank + 1) * ROWS]
    x8_ref, sx_ref = ref.quantize(x_full, ref.E4M3)
    w8_ref, sw_ref = ref.quantize(w, ref.E4M3)
    res = {"ag": {}, "rs": {}, "bytes": {}}

    for name, kw in AG.items():
        kw = dict(kw)
        if kw.pop("nodes", False):
            kw["nodes"] = _nodes(world)
        for dtype in (torch.bfloat16, torch.float32):
            y_ref = ref.mm(x8_ref, sx_ref, w8_ref.t(), sw_ref, dtype)
            stats.snapshot()
            tp.begin_pass("ag")
            sx = fp8.scale_for(fp8.shared_amax(x_local, tp, "ag_amax"), ref.E4M3)
            x8 = fp8.quantize(x_local, sx, ref.E4M3)
            sw = fp8.scale_for(fp8.amax(w), ref.E4M3)
            w8 = fp8.quantize(w, sw, ref.E4M3)
            out = torch.empty(world * ROWS, N, dtype=dtype)
            y, gathered = all_gather_matmul(x8, w8, tp, op="ag", out=out,
                                            gemm=fp8.ScaledGemm(sx, sw, dtype,
                                                                fast_accum=False), **kw)
            moved = stats.snapshot()["ag"]["bytes"]
            key = f"{name}-{str(dtype)[6:]}"
            # compared before the next pass: a ring's gathered tensor is the transport's
            # workspace, valid until its next begin_pass (on symm the next pass reuses it)
            res["ag"][key] = dict(
                out_is_ours=y is out, bit_equal=torch.equal(y, y_ref),
                gathered_fp8=gathered.dtype == ref.E4M3,
                gathered_equal=torch.equal(gathered.view(torch.uint8), x8_ref.view(torch.uint8)),
                scale_equal=torch.equal(sx, fp8.pair_of(sx_ref, sx_ref.reciprocal())),
                rel=ref.rel(y, y_ref))
            tp.begin_pass("ag")
            all_gather_matmul(x_local.to(torch.bfloat16), w.to(torch.bfloat16), tp, op="ag", **kw)
            moved_bf16 = stats.snapshot()["ag"]["bytes"]
            res["bytes"][key] = (moved, moved_bf16)

    # GEMM->RS: each rank multiplies its own partial input (all rows) by its own weight
    parts_in = [torch.randn(world * ROWS, K, generator=torch.Generator().manual_seed(10 + r))
                for r in range(world)]
    parts_w = [torch.randn(N, K, generator=torch.Generator().manual_seed(20 + r))
               for r in range(world)]
    for name, (method, splits, scatter) in RS.items():
        nodes = _nodes(world) if scatter == "nodes" else None
        scatter = bool(scatter)
        for dtype in (torch.float32, torch.bfloat16):
            want = ref.summed(parts_in, parts_w, rank, ROWS, scatter, dtype)
            tp.begin_pass("rs")
            sa = fp8.scale_for(fp8.amax(parts_in[rank]), ref.E4M3)
            sb = fp8.scale_for(fp8.amax(parts_w[rank]), ref.E4M3)
            a8 = fp8.quantize(parts_in[rank], sa, ref.E4M3)
            b8 = fp8.quantize(parts_w[rank], sb, ref.E4M3)
            out = torch.empty(want.shape, dtype=dtype)
            y = matmul_reduce_scatter(a8, b8, tp, method, splits, op="rs", scatter=scatter,
                                      nodes=nodes, out=out, gemm=fp8.ScaledGemm(sa, sb, dtype,
                                                                                fast_accum=False))
            res["rs"][f"{name}-{str(dtype)[6:]}"] = dict(dtype=y.dtype == dtype,
                                                         rel=ref.rel(y, want))

    # refused: a reduction of FP8, and an operand layout cuBLAS would refuse
    tp.begin_pass("bad")
    try:
        tp.reduce_scatter(torch.empty(ROWS, K, dtype=ref.E4M3), x8_ref, op="bad")
        res["fp8_reduction"] = "no error"
    except ContractError as exc:
        res["fp8_reduction"] = str(exc)
    try:
        fp8.ScaledGemm(sx_ref, sw_ref, torch.bfloat16, fast_accum=False)(x8_ref, w8_ref, op="bad")
        res["layout"] = "no error"
    except ValueError as exc:
        res["layout"] = str(exc)
    res["bf16_gemm_unchanged"] = torch.equal(matmul(x_local, w.t(), op="x"), x_local @ w.t())
    return res


@functools.cache
def _get(tp):
    return dist.run(_cases, tp, timeout=240)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_fp8_all_gather_gemm_is_bit_equal_to_one_whole_gemm(tp):
    for rank, r in enumerate(_get(tp)):
        assert len(r["ag"]) == 2 * len(AG)
        for case, got in r["ag"].items():
            assert got == dict(out_is_ours=True, bit_equal=True, gathered_fp8=True,
                               gathered_equal=True, scale_equal=True, rel=0.0), (rank, case, got)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_fp8_gathers_move_half_the_bytes_of_bf16(tp):
    for r in _get(tp):
        for case, (fp8_bytes, bf16_bytes) in r["bytes"].items():
            assert fp8_bytes > 0 and 2 * fp8_bytes == bf16_bytes, (case, fp8_bytes, bf16_bytes)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_fp8_gemm_reduce_scatter_sums_in_the_output_dtype(tp):
    bound = {"float32": 1e-6, "bfloat16": tp * 2.0 ** -9}
    for rank, r in enumerate(_get(tp)):
        assert len(r["rs"]) == 2 * len(RS)
        for case, got in r["rs"].items():
            assert got["dtype"] and got["rel"] <= bound[case.rsplit("-", 1)[1]], (rank, case, got)


def test_fp8_is_never_reduced_and_layouts_are_checked():
    r = _get(2)[0]
    assert "FP8 is gathered, never summed" in r["fp8_reduction"]
    assert "row-major x column-major" in r["layout"]
    assert r["bf16_gemm_unchanged"]


def _count_scaled_mm(monkeypatch) -> list:
    import torch

    calls, real = [], torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    return calls


@pytest.mark.parametrize("rowwise", [False, True])
def test_a_pipeline_chunk_is_one_fp8_gemm_over_every_ranks_rows(monkeypatch, rowwise):
    """A GEMM->RS pipeline chunk ([TP, rows, k], strided rows of the input, times the
    expanded weight) runs as one _scaled_mm over all TP x rows rows, not one per rank, and
    gives each entry's product as one GEMM of that entry alone does, bit for bit (row-wise:
    with the scales carried in the rows). A batch whose weights differ stays per entry."""
    import torch

    pytest.importorskip("torchao", reason="the [fp8] extra (torchao) is not installed")
    from megatron_overlap.overlap import fp8

    g = torch.Generator().manual_seed(5)
    world, splits, sub, k, n = 4, 2, 16, 64, 48
    x = torch.randn(world * splits * sub, k, generator=g)
    w = torch.randn(n, k, generator=g)
    e4 = torch.float8_e4m3fn
    if rowwise:
        x8, ws = fp8.rows_quantized(x, e4), fp8.row_scales(w, e4)
        gemm = fp8.RowScaledGemm(ws.t(), torch.bfloat16, fast_accum=False)
        w8 = fp8.quantize(w, ws, e4)
    else:
        xs, ws = fp8.scale_for(fp8.amax(x), e4), fp8.scale_for(fp8.amax(w), e4)
        x8, w8 = fp8.quantize(x, xs, e4), fp8.quantize(w, ws, e4)
        gemm = fp8.ScaledGemm(xs, ws, torch.bfloat16, fast_accum=False)
    chunk = x8.view(world, splits, sub, x8.shape[-1])[:, 1]  # the pipeline's chunk 1: strided
    wt = w8.t()
    calls = _count_scaled_mm(monkeypatch)
    got = gemm(chunk, wt.expand(world, *wt.shape), torch.empty(world, sub, n, dtype=torch.bfloat16),
               op="chunk")
    assert calls == [torch.Size([world * sub, k])]
    for r in range(world):
        assert torch.equal(got[r], gemm(chunk[r], wt, op="entry")), r
    calls.clear()
    own = torch.stack([w8, w8]).transpose(1, 2)  # a weight per entry (stored twice): per entry
    got2 = gemm(chunk[:2], own, op="own")
    assert len(calls) == 2 and torch.equal(got2, got[:2])


def test_transposed_copies_are_exact_and_the_compiled_kernels_can_be_switched_off():
    """`transposed` (the FP8 GEMMs' layouts; a compiled kernel on a GPU, torch's copy
    here) equals t.t() for FP8 and other dtypes; set_fused returns the previous setting."""
    import torch

    from megatron_overlap.overlap import fp8

    t = torch.randn(33, 80).to(torch.float8_e5m2)
    got = fp8.transposed(t)
    assert got.is_contiguous() and got.shape == (80, 33)
    assert torch.equal(got.view(torch.uint8), t.t().contiguous().view(torch.uint8))
    assert torch.equal(fp8.transposed(t.t()).view(torch.uint8), t.view(torch.uint8))
    b = torch.randn(5, 7, dtype=torch.bfloat16)
    assert torch.equal(fp8.transposed(b), b.t())
    assert fp8.set_fused(False) is True
    try:
        assert fp8.set_fused(False) is False
    finally:
        fp8.set_fused(True)
