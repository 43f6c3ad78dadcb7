"""Row-wise FP8 scaling (install(fp8_scaling='rowwise') on fp8_recipe='tensorwise'): the
schedules unchanged with row-scaled chunks (their scales travel in their rows), the
layers against the independent row-wise reference (helpers/fp8_ref.py,
helpers/fp8_layers.py: each tensor quantized per row or per column at once, one
whole-tensor `torch._scaled_mm`), TP 2 and 4, and what row-wise refuses.

Bounds, and why:
- Bit-equal where nothing is summed over ranks: every AG->GEMM output (each row has its
  own scale, so a rank's rows quantized alone are the whole tensor's rows, and each
  output row of a chunk GEMM is that row of the whole GEMM), the gathered values and
  scales, the column layer's output, weight grad and bias grad, the row layer's input,
  weight and bias grads.
- Sums over ranks (GEMM->RS; the column input grad, the row output): each rank's bf16
  partial equals the reference's; only the summation differs: at most TP roundings of
  2^-9 (one more for the row layer's bias add), as for tensorwise.
- Bytes: a gathered row-scaled row is K values and a 16-byte tail (its scale), so the
  gather moves (K + 16) / 2K of bf16's bytes.
"""

import functools

import pytest
import torch

from helpers import dist
from helpers.fp8_layers import Fp8Case, rowwise_cases, run_cases
from helpers.fp8_schedule_cases import AG, K, N, ROWS, RS, TP_SIZES, _nodes  # noqa: F401


def _schedules(rank, world):
    import torch.distributed as tdist

    from helpers import fp8_ref as ref
    from megatron_overlap.comm import TorchP2PTransport, stats
    from megatron_overlap.overlap import all_gather_matmul, fp8, matmul_reduce_scatter

    tdist.init_process_group("gloo", rank=rank, world_size=world)
    tp = TorchP2PTransport(tdist.group.WORLD)
    g = torch.Generator().manual_seed(1)
    x_full = torch.randn(world * ROWS, K, generator=g) * torch.logspace(-2, 2, world * ROWS)[:, None]
    w = torch.randn(N, K, generator=g)
    x_local = x_full[rank * ROWS:(rank + 1) * ROWS]
    w8_ref, sw_ref = ref.quantize_axis(w, ref.E4M3, 1)
    res = {"ag": {}, "rs": {}, "bytes": {}}
    bf16 = torch.bfloat16
    for name, kw in AG.items():
        kw = dict(kw)
        if kw.pop("nodes", False):
            kw["nodes"] = _nodes(world)
        for a_dtype in (ref.E4M3, ref.E5M2):  # e5m2: a 'hybrid' gradient as the first operand
            x8_ref, sx_ref = ref.quantize_axis(x_full, a_dtype, 1)
            y_ref = ref.mm(x8_ref, sx_ref, w8_ref.t(), sw_ref.t(), bf16)
            stats.snapshot()
            tp.begin_pass("ag")
            x8 = fp8.rows_quantized(x_local, a_dtype)
            sw = fp8.row_scales(w, ref.E4M3)
            w8 = fp8.quantize(w, sw, ref.E4M3)
            out = torch.empty(world * ROWS, N, dtype=bf16)
            y, gathered = all_gather_matmul(x8, w8, tp, op="ag", out=out,
                                            gemm=fp8.RowScaledGemm(sw.t(), bf16,
                                                                   fast_accum=False), **kw)
            moved = stats.snapshot()["ag"]["bytes"]
            tp.begin_pass("ag")
            all_gather_matmul(x_local.to(bf16), w.to(bf16), tp, op="ag", **kw)
            key = f"{name}-{str(a_dtype)[6:]}"
            res["ag"][key] = dict(
                out_is_ours=y is out, bit_equal=torch.equal(y, y_ref),
                values_equal=torch.equal(fp8.row_data(gathered).view(torch.uint8),
                                         x8_ref.view(torch.uint8)),
                scales_equal=torch.equal(fp8.row_scale(gathered), sx_ref),
                weight_scales_equal=torch.equal(sw, sw_ref))
            res["bytes"][key] = (moved, stats.snapshot()["ag"]["bytes"])

    parts_in = [torch.randn(world * ROWS, K, generator=torch.Generator().manual_seed(10 + r))
                for r in range(world)]
    parts_w = [torch.randn(N, K, generator=torch.Generator().manual_seed(20 + r))
               for r in range(world)]
    for name, (method, splits, scatter) in RS.items():
        nodes = _nodes(world) if scatter == "nodes" else None
        scatter = bool(scatter)
        partials = []
        for r in range(world):
            a8, sa = ref.quantize_axis(parts_in[r], ref.E4M3, 1)
            b8, sb = ref.quantize_axis(parts_w[r], ref.E4M3, 1)
            partials.append(ref.mm(a8, sa, b8.t(), sb.t(), bf16).double())
        total = sum(partials)
        want = total[rank * ROWS:(rank + 1) * ROWS] if scatter else total
        tp.begin_pass("rs")
        a8 = fp8.rows_quantized(parts_in[rank], ref.E4M3)
        sb = fp8.row_scales(parts_w[rank], ref.E4M3)
        b8 = fp8.quantize(parts_w[rank], sb, ref.E4M3)
        out = torch.empty(want.shape, dtype=bf16)
        y = matmul_reduce_scatter(a8, b8, tp, method, splits, op="rs", scatter=scatter,
                                  nodes=nodes, out=out, gemm=fp8.RowScaledGemm(sb.t(), bf16,
                                                                               fast_accum=False))
        res["rs"][name] = dict(dtype=y.dtype == bf16, rel=ref.rel(y, want))

    # refused as torch's row-wise GEMM refuses them: an e5m2 second operand, fp32 output
    x8 = fp8.rows_quantized(x_local, ref.E4M3)
    for key, b, dtype in (("e5m2_second", w8_ref.to(torch.float32).to(ref.E5M2).t(), bf16),
                          ("fp32_out", w8_ref.t(), torch.float32)):
        try:
            fp8.RowScaledGemm(sw_ref.t(), dtype, fast_accum=False)(x8, b, op="bad")
            res[key] = "no error"
        except TypeError as exc:
            res[key] = str(exc)
    return res


@functools.cache
def _sched_for(tp):
    return dist.run(_schedules, tp, timeout=240)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_rowwise_all_gather_gemm_is_bit_equal_to_one_whole_gemm(tp):
    for rank, r in enumerate(_sched_for(tp)):
        assert len(r["ag"]) == 2 * len(AG)
        for case, got in r["ag"].items():
            assert all(got.values()), (rank, case, got)


@pytest.mark.parametrize("tp", TP_SIZES)
def test_rowwise_gathers_move_the_values_and_their_scales(tp):
    for r in _sched_for(tp):
        for case, (fp8_bytes, bf16_bytes) in r["bytes"].items():
            assert fp8_bytes > 0 and fp8_bytes * 2 * K == bf16_bytes * (K + 16), case


@pytest.mark.parametrize("tp", TP_SIZES)
def test_rowwise_gemm_reduce_scatter_within_the_bf16_bound(tp):
    for rank, r in enumerate(_sched_for(tp)):
        assert len(r["rs"]) == len(RS)
        for case, got in r["rs"].items():
            assert got["dtype"] and 0 < got["rel"] <= tp * 2.0 ** -9, (rank, case, got)


def test_rowwise_gemm_refuses_what_torchs_rowwise_kernel_refuses():
    r = _sched_for(2)[0]
    assert "second operand in e4m3" in r["e5m2_second"]
    assert "outputs bf16" in r["fp32_out"]


# -- the layers ------------------------------------------------------------------------------
_layers: dict[int, list] = {}


def _layers_for(tp: int) -> list[dict]:
    if tp not in _layers:
        _layers[tp] = dist.run(run_cases, tp, rowwise_cases(), timeout=600)
    return _layers[tp]


def _check(case: Fp8Case, per_rank: list[dict], tp: int) -> None:
    reduced = "input_grad" if case.kind == "column" else "output"
    bound = (tp + (1 if case.kind == "row" else 0)) * 2.0 ** -9
    grads = "e5m2" if case.fp8 == "hybrid" else "e4m3fn"
    for rank, r in enumerate(per_rank):
        got = r[case.id]
        assert not got["megatron_forward"], got
        assert got["precision"] == (f"fp8 rowwise (e4m3fn fprop, {grads} grads, wgrad high "
                                    f"precision, fast accumulation: fprop)"), got
        for key in ("output", "input_grad", "weight_grad", "bias_grad"):
            v = got[key]
            assert v["dtype"], (rank, key, v)
            if key == reduced:
                assert 0 < v["rel"] <= bound, (rank, key, v, bound)
            else:
                assert v["equal"], (rank, key, v)


@pytest.mark.parametrize("tp,case", [(tp, c) for tp in TP_SIZES for c in rowwise_cases()],
                         ids=lambda v: f"tp{v}" if isinstance(v, int) else v.id)
def test_rowwise_layer_matches_the_rowwise_reference(tp, case):
    _check(case, _layers_for(tp), tp)


def _per_peer_cases() -> list[Fp8Case]:
    rw = dict(dtype="bfloat16", fp8_wgrad=False, scaling="rowwise")
    return [Fp8Case(kind, v, True, **rw) for kind, v in (
        ("column", "ring"), ("column", "rs_dgrad_ring"), ("row", "pipeline2"), ("row", "ring"))]


def test_rowwise_layer_through_per_peer_transports_and_hierarchical_orders():
    per_rank = dist.run(run_cases, 4, _per_peer_cases(), env={"LOCAL_WORLD_SIZE": "2"},
                        timeout=400)
    for case in _per_peer_cases():
        _check(case, per_rank, 4)
        for r in per_rank:
            got = r[case.id]
            assert got["transport"] == "hierarchical", got
            assert got["orders"] and all(o == "hierarchical (2x2)"
                                         for o in got["orders"].values()), got


# -- how it is chosen, and what it refuses ---------------------------------------------------
def _config(**kw):
    from megatron.core.transformer import TransformerConfig

    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                fp8="hybrid", fp8_recipe="tensorwise", fp8_wgrad=False,
                params_dtype=torch.bfloat16)
    return TransformerConfig(**{**base, **kw})


@pytest.fixture
def rowwise():
    from megatron_overlap.layers import precision

    previous = precision.set_scaling("rowwise")
    yield precision
    precision.set_scaling(previous)


@pytest.mark.parametrize("fmt,grad", [("hybrid", torch.float8_e5m2), ("e4m3", torch.float8_e4m3fn)])
def test_rowwise_is_chosen_on_megatrons_tensorwise_recipe(rowwise, fmt, grad):
    p = rowwise.layer_precision(_config(fp8=fmt), "qkv (column)", 2)
    assert (p.recipe, p.fwd, p.grad, p.wgrad) == ("rowwise", torch.float8_e4m3fn, grad, False)
    rowwise.set_scaling("tensorwise")
    assert rowwise.layer_precision(_config(fp8=fmt), "qkv (column)", 2).recipe == "tensorwise"


@pytest.mark.parametrize("kw,key,says", [
    (dict(fp8_wgrad=True), "fp8_wgrad", "set fp8_wgrad=False (--no-fp8-wgrad)"),
    (dict(params_dtype=torch.float32), "params_dtype", "outputs bf16 only"),
    (dict(fp8_recipe="delayed"), "fp8_recipe", "current scaling"),
])
def test_rowwise_refuses_what_it_does_not_run(rowwise, kw, key, says):
    from megatron_overlap.config import ConfigError

    with pytest.raises(ConfigError) as exc:
        rowwise.layer_precision(_config(**kw), "fc1 (column)", 2)
    assert exc.value.key == key and exc.value.layer == "fc1 (column)" and says in str(exc.value)


def test_fp8_recipe_rowwise_on_the_config_points_to_the_setting():
    from megatron_overlap.config import ConfigError
    from megatron_overlap.layers.precision import layer_precision

    with pytest.raises(ConfigError) as exc:  # megatron-core's config takes it; Megatron does not
        layer_precision(_config(fp8_recipe="rowwise"), "fc1 (column)", 2)
    assert exc.value.key == "fp8_recipe" and "install(fp8_scaling='rowwise')" in str(exc.value)


def test_install_refuses_an_unknown_scaling_and_uninstall_restores_it():
    import megatron_overlap as mo
    from megatron_overlap.layers import precision

    with pytest.raises(ValueError, match="fp8_scaling must be one of"):
        mo.install(fp8_scaling="columnwise")
    mo.install(fp8_scaling="rowwise")
    try:
        assert precision.chosen("fp8_scaling") == "rowwise"
    finally:
        mo.uninstall()
    assert precision.chosen("fp8_scaling") == "tensorwise"


def _built(rank, world):
    """Row-wise layers (SP, TP 2) next to bf16 ones: the bytes each pass moved and the
    settings rows say; and the door refusing activations the GEMM cannot output."""
    import megatron_overlap as mo
    from helpers.fp8_layers import build, config, rows_and_moved
    from helpers.megatron_cpu import init
    from megatron_overlap.comm import stats
    from megatron_overlap.layers.checks import LayerInputError

    init(world)
    fp8 = dict(fp8="hybrid", fp8_recipe="tensorwise", fp8_wgrad=False)
    out = {}
    layers = {}
    for p in ("rowwise", "bf16"):
        mo.install(fp8_scaling="rowwise")
        try:
            layers[p] = {k: build(k, config(world, True, torch.bfloat16,
                                            **(fp8 if p == "rowwise" else {})))
                         for k in ("column", "row")}
        finally:
            mo.uninstall()
    out.update(rows_and_moved(layers, world))
    stats.snapshot()
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            layers["rowwise"]["column"](torch.randn(8, 2, 32))
        out["door"] = "ran"
    except LayerInputError as exc:
        out["door"] = str(exc)
    out["moved_after_refusal"] = stats.snapshot()
    return out


@pytest.fixture(scope="module")
def built():
    return dist.run(_built, 2, timeout=240)[0]


def test_rowwise_bytes_in_the_settings_rows_and_the_transport_include_the_scales(built):
    tokens, width = 2 * 8 * 2, 32  # SP: 8 x 2 tokens per rank, 2 ranks; both layers 32 wide
    fp8, bf16 = built["rows_rowwise_column"], built["rows_bf16_column"]
    assert all(p.startswith("fp8 rowwise") for _, p in fp8.values())
    assert fp8["fprop"][0] == tokens * (width + 16) and bf16["fprop"][0] == tokens * width * 2
    assert fp8["dgrad"] == (bf16["dgrad"][0], fp8["dgrad"][1])  # the bf16 input, for the wgrad
    fp8, bf16 = built["rows_rowwise_row"], built["rows_bf16_row"]
    assert fp8["dgrad"][0] == tokens * (width + 16) and fp8["fprop"][0] == bf16["fprop"][0]
    moved, moved_bf16 = built["moved_rowwise"], built["moved_bf16"]
    assert not any(op.endswith("_amax") for op in moved)  # each row its own scale: no exchange
    for op in ("qkv_fprop", "proj_dgrad"):  # a gather: (32 values + 16 bytes) vs 32 x 2 bytes
        assert moved[op] * 64 == moved_bf16[op] * 48, (op, moved, moved_bf16)
    assert moved["proj_fprop"] == moved_bf16["proj_fprop"]  # the reduce-scatter stays bf16


def test_rowwise_door_refuses_activations_the_gemm_cannot_output(built):
    assert "row-wise FP8 GEMM outputs bf16" in built["door"] and "torch.float32" in built["door"]
    assert built["moved_after_refusal"] == {}


def _mixed(rank, world):
    """Rank 0 row-wise, rank 1 tensorwise: other bytes per row, an amax exchange on one
    side only; the first call is a diagnosed disagreement before any transfer."""
    from helpers.fp8_layers import first_call

    return first_call(world, {"fp8_scaling": "rowwise" if rank == 0 else "tensorwise"},
                      fp8="hybrid", fp8_recipe="tensorwise", fp8_wgrad=False)


def test_ranks_that_disagree_on_the_scaling_are_diagnosed_before_any_transfer():
    for r in dist.run(_mixed, 2, timeout=240):
        assert r["error"] and "fp8 rowwise" in r["error"] and "fp8 tensorwise" in r["error"], r
        assert r["moved"] == {}
