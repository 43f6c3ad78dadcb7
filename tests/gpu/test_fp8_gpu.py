"""FP8 on the GPU: 2 TP ranks sharing the one GPU (gloo process group, `symm` transport),
one set of processes for the whole file (a module fixture, one xdist worker).

1. Each layer kind (column under SP: FP8 all-gather; row under SP: reduce-scatter; both
   without SP) against torchao's `Float8Linear` (tensorwise recipe) on the same whole
   weight, input and upstream gradient (tests/helpers/fp8_torchao.py). Not bit-equal by
   design: our weight scale is our TP shard's amax, Float8Linear's the whole weight's; a
   row layer's input scale is its shard's; a column layer's gradient scale its columns'.
   A different scale rounds the same values differently, with the same statistics. So,
   against the exact product (fp32 GEMMs of the same bf16 tensors):
   - ours is as accurate as torchao's: rel(ours, exact) <= 1.1 rel(torchao, exact) + 0.003;
   - ours and torchao's differ as two independent roundings do, at most ~sqrt(2) times
     either's error: rel(ours, torchao) <= 1.6 rel(torchao, exact);
   - torchao's own error is FP8's: <= 0.05 for the output (two e4m3 operands: 3 mantissa
     bits) and <= 0.09 for the gradients (e5m2: 2 mantissa bits); measured on CPU 0.037
     and 0.059; a wrong scale or operand gives errors of order 1.
2. The schedules (ring, aggregated ring, bulk AG->GEMM; pipeline 1 and 2, ring, bulk
   GEMM->RS; all-reduce) carrying FP8 through symm against the independent reference
   (helpers/fp8_ref.py: the whole tensor quantized at once, one whole-tensor _scaled_mm):
   the gathered FP8 bytes and the scale bit-equal; the products within cuBLAS's
   accumulation order (chunk GEMMs against one whole GEMM: fp32 1e-5, bf16 one rounding
   2^-8) plus, where summed over ranks, TP + 1 roundings of 2^-9 (tests/test_fp8_layers.py).
3. The public FP8 layers on symm with the pass replay (CUDA graphs captured, replayed):
   every step bit-equal to the same steps run eagerly, replays counted
   (`overlap.replay.totals()`), and the results against the FP8 reference within 2^-7.
4. Row-wise FP8 layers (install(fp8_scaling='rowwise')) on symm against the row-wise
   reference of tests/test_fp8_rowwise.py, within one bf16 rounding (plus the sum over
   ranks where there is one).
"""

import itertools

import pytest

from helpers import dist, gpu
from helpers import fp8_delayed as _delayed
from helpers import fp8_layers as _layers

pytestmark = pytest.mark.xdist_group("fp8_gpu")
TP = 2
ROWS, K, N = 64, 128, 96
LAYER_CASES = [("column", True, None), ("row", True, None), ("column", False, None),
               ("row", False, None),
               ("column", True, {"qkv_fprop": {"method": "ring_exchange", "aggregate": 1}}),
               ("row", True, {"proj_fprop": {"method": "ring_exchange"}})]
REPLAY_CASES = [("column", "ring"), ("column", "rs_dgrad_pipeline2"), ("row", "pipeline2"),
                ("row", "ring")]
DELAYED = [  # (helpers/fp8_delayed.py)
    _delayed.DelayedCase(_layers.Fp8Case("column", "ring", True, "bfloat16"), 3, "max", 1),
    _delayed.DelayedCase(_layers.Fp8Case("row", "pipeline2", True, "bfloat16"))]
ROWWISE = [("column", "ring", True), ("column", "rs_dgrad_ring", True), ("row", "pipeline2", True),
           ("row", "ring", True), ("column", "ring", False), ("row", "pipeline2", False)]


def _rowwise_cases():
    from helpers.fp8_layers import Fp8Case

    return [Fp8Case(kind, v, sp, "bfloat16", fp8_wgrad=False, scaling="rowwise")
            for kind, v, sp in ROWWISE]


def _method(ub: dict | None) -> str:
    """The fprop method a case's overrides set (TE's default without)."""
    if not ub:
        return "default"
    (s,) = ub.values()
    return s["method"] + ("_aggregate" if s.get("aggregate") else "")


def _vs_torchao(rank, world):
    from helpers.fp8_torchao import compare

    return {(kind, sp, str(ub)): compare(rank, world, kind, sp, "cuda", ub_cfgs=ub)
            for kind, sp, ub in LAYER_CASES}


def _schedules(rank, world):
    import torch

    from helpers import fp8_ref as ref
    from megatron_overlap.comm import stats
    from megatron_overlap.overlap import all_gather_matmul, fp8, matmul_reduce_scatter

    tp = gpu.symm()
    g = torch.Generator().manual_seed(1)
    x_full = (torch.randn(world * ROWS, K, generator=g) * 3).cuda()
    w = torch.randn(N, K, generator=g).cuda()
    x_local = x_full[rank * ROWS:(rank + 1) * ROWS]
    x8_ref, sx_ref = ref.quantize(x_full, ref.E4M3)
    w8_ref, sw_ref = ref.quantize(w, ref.E4M3)
    res = {"ag": {}, "rs": {}}
    for name, kw in {"ring": dict(method="ring_exchange"), "bulk": dict(method="bulk"),
                     "ring_aggregate": dict(method="ring_exchange", aggregate=True)}.items():
        for dtype in (torch.bfloat16, torch.float32):
            stats.snapshot()
            tp.begin_pass("ag")
            sx = fp8.scale_for(fp8.shared_amax(x_local, tp, "ag_amax"), ref.E4M3)
            x8 = fp8.quantize(x_local, sx, ref.E4M3)
            sw = fp8.scale_for(fp8.amax(w), ref.E4M3)
            y, gathered = all_gather_matmul(x8, fp8.quantize(w, sw, ref.E4M3), tp, op="ag",
                                            out=torch.empty(world * ROWS, N, dtype=dtype, device="cuda"),
                                            gemm=fp8.ScaledGemm(sx, sw, dtype,
                                                                fast_accum=False), **kw)
            moved = stats.snapshot()["ag"]["bytes"]
            # compared now: the rings gather into the transport's workspace, valid until its
            # next begin_pass (on symm the bf16 pass below writes the same place)
            got = dict(gathered_equal=torch.equal(gathered.view(torch.uint8), x8_ref.view(torch.uint8)),
                       scale_equal=torch.equal(sx, fp8.pair_of(sx_ref, sx_ref.reciprocal())))
            tp.begin_pass("ag")
            all_gather_matmul(x_local.to(torch.bfloat16), w.to(torch.bfloat16), tp, op="ag", **kw)
            moved_bf16 = stats.snapshot()["ag"]["bytes"]
            res["ag"][f"{name}-{str(dtype)[6:]}"] = dict(
                **got, bytes=(moved, moved_bf16),
                rel=ref.rel(y, ref.mm(x8_ref, sx_ref, w8_ref.t(), sw_ref, dtype)))
    parts_in = [torch.randn(world * ROWS, K, generator=torch.Generator().manual_seed(10 + r)).cuda()
                for r in range(world)]
    parts_w = [torch.randn(N, K, generator=torch.Generator().manual_seed(20 + r)).cuda()
               for r in range(world)]
    for name, (method, splits, scatter) in {
            "pipeline1": ("pipeline", 1, True), "pipeline2": ("pipeline", 2, True),
            "ring": ("ring_exchange", 1, True), "bulk": ("bulk", 1, True),
            "allreduce_pipeline2": ("pipeline", 2, False)}.items():
        for dtype in (torch.float32, torch.bfloat16):
            want = ref.summed(parts_in, parts_w, rank, ROWS, scatter, dtype)
            tp.begin_pass("rs")
            sa = fp8.scale_for(fp8.amax(parts_in[rank]), ref.E4M3)
            sb = fp8.scale_for(fp8.amax(parts_w[rank]), ref.E4M3)
            y = matmul_reduce_scatter(fp8.quantize(parts_in[rank], sa, ref.E4M3),
                                      fp8.quantize(parts_w[rank], sb, ref.E4M3), tp, method, splits,
                                      op="rs", scatter=scatter,
                                      out=torch.empty(want.shape, dtype=dtype, device="cuda"),
                                      gemm=fp8.ScaledGemm(sa, sb, dtype, fast_accum=False))
            res["rs"][f"{name}-{str(dtype)[6:]}"] = dict(dtype=y.dtype == dtype, rel=ref.rel(y, want))
    torch.cuda.synchronize()
    tp.check()
    return res


def _layers_replay(rank, world):
    import torch

    import megatron_overlap as mo
    from helpers import fp8_layers as fl
    from helpers.layers import VARIANTS
    from megatron_overlap.overlap import replay

    out = {}
    for (kind, variant), recipe in itertools.product(REPLAY_CASES, ("tensorwise", "delayed")):
        case = fl.Fp8Case(kind, variant, True, "bfloat16")
        overrides, flags = VARIANTS[kind][variant]
        delayed = dict(fp8_amax_history_len=4, fp8_amax_compute_algo="max") \
            if recipe == "delayed" else {}
        mo.install(ub_cfgs=overrides)
        try:  # two alike: delayed scaling's histories move with every step, so eager runs anew
            layer, fresh = (fl.build(kind, fl.config(world, True, torch.bfloat16, flags,
                                                     fp8="hybrid", fp8_recipe=recipe,
                                                     **delayed)).cuda() for _ in range(2))
        finally:
            mo.uninstall()
        steps = []
        for seed in range(4):  # fixed buffers, new values each step: what a replay must honour
            whole = [t.cuda() for t in fl._whole(case, world, torch.bfloat16, seed=seed)]
            steps.append((whole, fl._shards(case, rank, world, *whole)))
        w_r, b_r, x_r, dy_r = steps[0][1]
        x, dy = x_r.clone(), dy_r.clone()

        def run(values, layer=layer):
            y, xi = fl.step_with(layer, x, dy, values)
            # Kept on the host, as a training step keeps nothing of the step on the device:
            # device copies made here, after the backward freed the forward's FP8 input, weight
            # and scales and kept for the whole test, would take those blocks, so each next
            # forward's FP8 tensors would land elsewhere and no pass signature would recur (the
            # bf16 layers' are all still alive here). tests/test_fp8_replay.py shows both.
            res = {"output": y.detach().reshape(-1, y.shape[-1]).cpu(), "input_grad": xi.grad.cpu(),
                   "weight_grad": layer.weight.grad.cpu(), "bias_grad": layer.bias.grad.cpu()}
            del y, xi
            return res
        before = replay.totals()
        graphed = [run(s[1]) for s in steps]
        graphed += [run(s[1]) for s in steps]  # the stored graphs replayed again
        after = replay.totals()
        replay.set_enabled(False)
        try:
            if recipe == "delayed":  # the same 8 steps on a layer that never replays
                eager = [run(s[1], fresh) for s in steps + steps]
            else:
                eager = [run(s[1]) for s in steps] * 2
        finally:
            replay.set_enabled(None)
        torch.cuda.synchronize()
        want = [{k: v.cpu() for k, v in fl.reference(case, rank, world, *s[0]).items()}
                for s in steps] if recipe == "tensorwise" else None
        out[(kind, variant, recipe)] = dict(
            precision=layer.precision.describe(), transport=layer.transport.name,
            replays=after["replays"] - before["replays"], captures=after["captures"] - before["captures"],
            per_pass={p: (g.replays, g.captures) for p, g in layer.pass_graphs.items()},
            not_captured={p: g.failed or g.off for p, g in layer.pass_graphs.items()},
            eager_equal=all(torch.equal(a[k], b[k]) for a, b in zip(graphed, eager) for k in a),
            rel=want and {k: max(fl.ref.rel(e[k].reshape(w[k].shape), w[k])
                                 for e, w in zip(eager, want)) for k in eager[0]})
        layer.transport.check()
    return out


def _all(rank, world):
    import torch
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    gpu.init()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model_parallel_cuda_manual_seed(0)
    from helpers import fp8_delayed
    from helpers.fp8_layers import run_case

    return {"torchao": _vs_torchao(rank, world), "schedules": _schedules(rank, world),
            "replay": _layers_replay(rank, world),
            "rowwise": {c.id: run_case(c, rank, world, device="cuda") for c in _rowwise_cases()},
            "delayed": {c.id: fp8_delayed.run_case(c, rank, world, device="cuda")
                        for c in DELAYED},
            "device": torch.cuda.get_device_name()}


@pytest.fixture(scope="module")
def results():
    import torch

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip(f"FP8 GEMMs need compute capability >= 8.9 (missing hardware: "
                    f"{torch.cuda.get_device_name()} is {torch.cuda.get_device_capability()})")
    pytest.importorskip("torchao.float8", reason="torchao is not installed (the [fp8] extra; "
                        "benchmarks/fp8_gpu_session.sh installs its wheel from .whl/)")
    return dist.run(_all, TP, env=gpu.ENV, timeout=400)


@pytest.mark.parametrize("case", LAYER_CASES, ids=lambda c: f"{c[0]}-sp{int(c[1])}-{_method(c[2])}")
def test_fp8_layer_against_torchao_float8linear(results, case):
    kind, sp, ub = case
    for rank, r in enumerate(results):
        got = r["torchao"][(kind, sp, str(ub))]
        assert got["precision"].startswith("fp8 tensorwise") and not got["megatron_forward"], got
        assert got["transport"] == "symm", got
        for key in ("output", "input_grad", "weight_grad"):
            e = got[key]
            assert e["dtype"] == "torch.bfloat16", (rank, key, e)
            assert e["ao_exact"] <= (0.05 if key == "output" else 0.09), (rank, key, e)
            assert e["ours_exact"] <= 1.1 * e["ao_exact"] + 0.003, (rank, key, e)
            assert e["ours_ao"] <= 1.6 * e["ao_exact"], (rank, key, e)


def test_fp8_schedules_on_symm_match_one_whole_scaled_mm(results):
    for rank, r in enumerate(results):
        ag, rs = r["schedules"]["ag"], r["schedules"]["rs"]
        assert len(ag) == 6 and len(rs) == 10, (ag, rs)
        for case, got in ag.items():
            tol = 2.0 ** -8 if case.endswith("bfloat16") else 1e-5
            assert got["gathered_equal"] and got["scale_equal"], (rank, case, got)
            fp8_bytes, bf16_bytes = got["bytes"]  # FP8 moved: half the bytes of bf16
            assert fp8_bytes > 0 and 2 * fp8_bytes == bf16_bytes, (rank, case, got)
            assert got["rel"] <= tol, (rank, case, got)
        for case, got in rs.items():
            tol = 2.0 ** -8 + (TP + 1) * 2.0 ** -9 if case.endswith("bfloat16") else 1e-5
            assert got["dtype"] and got["rel"] <= tol, (rank, case, got)


@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
@pytest.mark.parametrize("case", REPLAY_CASES, ids=lambda c: "-".join(c))
def test_fp8_layers_replay_equal_eager_and_the_reference(results, case, recipe):
    """Replayed passes give eager's bits (delayed scaling: a twin layer run eagerly through
    the same 8 steps, its histories updated alike); tensorwise also against the reference
    (delayed's own, step after step on the GPU: test_delayed_layers_on_the_gpu_...)."""
    for rank, r in enumerate(results):
        got = r["replay"][(*case, recipe)]
        assert got["precision"].startswith(f"fp8 {recipe}") and got["transport"] == "symm", got
        assert got["eager_equal"], (rank, got)
        # 8 forwards and 8 backwards: the first of each pass eager (new addresses), then
        # captured where its tensors recur, then replayed; the second round replays the
        # stored graphs: both passes captured, each replayed more often than captured
        assert got["captures"] >= 2 and got["replays"] >= 4, (rank, got)
        assert all(rp > cp for rp, cp in got["per_pass"].values()), (rank, got)
        for key, rel in (got["rel"] or {}).items():
            assert rel <= 2.0 ** -7, (rank, key, got["rel"])


@pytest.mark.parametrize("case", ROWWISE, ids=lambda c: f"{c[0]}-{c[1]}-sp{int(c[2])}")
def test_rowwise_fp8_layers_on_the_gpu_match_the_rowwise_reference(results, case):
    """Row-wise FP8 layers (scales in each row's tail, torch's row-wise GEMM kernel, the
    wgrad in bf16) on symm against the CPU's row-wise reference (tests/test_fp8_rowwise.py):
    the same FP8 operands, so what differs is the GPU GEMMs' accumulation order, one bf16
    rounding (2^-8), plus, where summed over ranks, TP + 1 roundings of 2^-9."""
    (c,) = [c for c in _rowwise_cases() if (c.kind, c.variant, c.sp) == case]
    reduced = "input_grad" if c.kind == "column" else "output"
    for rank, r in enumerate(results):
        got = r["rowwise"][c.id]
        assert got["precision"].startswith("fp8 rowwise") and not got["megatron_forward"], got
        assert got["transport"] == "symm", got
        for key in ("output", "input_grad", "weight_grad", "bias_grad"):
            v = got[key]
            bound = 2.0 ** -8 + ((TP + 1) * 2.0 ** -9 if key == reduced else 0.0)
            assert v["dtype"] and v["rel"] <= bound, (rank, key, v, bound)


@pytest.mark.parametrize("case", DELAYED, ids=lambda c: c.id)
def test_delayed_layers_on_the_gpu_match_the_reference_step_after_step(results, case):
    """Delayed scaling on symm, its casts and updates compiled, 4 steps: the CPU's reference
    with Transformer Engine's scales (tests/test_fp8_delayed.py). The same FP8 operands, so
    the GPU GEMMs' accumulation order and one bf16 rounding differ (2^-8), plus TP + 1
    roundings of 2^-9 where summed over ranks; the histories restored from the state dict
    give the next step to the bit."""
    reduced = "input_grad" if case.layer.kind == "column" else "output"
    for rank, r in enumerate(results):
        got = r["delayed"][case.id]
        assert got["precision"].startswith("fp8 delayed") and got["restored"] == [True, True], got
        assert got["held"] == got["want_held"]  # the layer's scales: the rule's, to the bit
        for step, results_ in enumerate(got["steps"]):
            for key, v in results_.items():
                bound = 2.0 ** -8 + ((TP + 1) * 2.0 ** -9 if key == reduced else 0)
                assert v["rel"] <= bound, (rank, step, key, v)
