"""The cost model and the tuner in FP8 (`simulate.numerics`, `Shape.numerics`): the bytes each
pass's schedule moves, recorded from the schedules' own code, halve for FP8 gathers (plus
row-wise scale tails) and stay for reductions; FP8 GEMMs take the FP8 peak; model-only picks
move where the numbers move; the tuner's measured modes time the FP8 passes on CPU (gloo
ranks on torch_p2p, and the null transport); the CLI says the precision and refuses what
the layers do not run."""

import collections
import dataclasses
import json
import math

import pytest
import torch

from helpers import dist
from megatron_overlap.cli import main
from megatron_overlap.config import LayerSettings, OverlapConfig
from megatron_overlap.simulate import (
    Calibration, GemmModel, Hardware, Layout, Shape, parse_shapes, roofline_us, simulate,
    simulate_pass, trials,
)
from megatron_overlap.simulate.numerics import Numerics
from megatron_overlap.simulate.passes import PassSpec, amax_exchange_us, fp8_work, run_of
from megatron_overlap.simulate.runs import recorded

HW = Hardware()
LAYOUT = Layout(tp=4)
BF16 = Numerics()
HYBRID = Numerics(fp8="hybrid")
NO_FP8_WGRAD = Numerics(fp8="e4m3", fp8_wgrad=False)
ROWWISE = Numerics(fp8="hybrid", scaling="rowwise", fp8_wgrad=False)
DELAYED = Numerics(fp8="hybrid", scaling="delayed")
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _shapes(numerics):
    return {s.buffer: s for s in parse_shapes("8b", 4, numerics)}


def _moved(numerics, buffer, pass_name, method):
    """(bytes sent point to point, bytes of collectives' blocks, GEMM events) that rank 0
    of the pass's recorded schedule issues."""
    spec = PassSpec(_shapes(numerics)[buffer], pass_name)
    s = LayerSettings.default(spec.name, method)
    events = recorded(run_of(spec, s, LAYOUT))[0]
    p2p = sum(b for e in events if e[0] == "exchange" for _, b, _ in e[2])
    coll = sum(e[3] for e in events if e[0] == "collective")
    return p2p, coll, [e[1:4] for e in events if e[0] == "gemm"]


# (buffer, pass, method, what FP8 does to its bytes: "half" gathers, "same" reductions)
PASSES = [("qkv", "fprop", "ring_exchange", "half"), ("fc1", "wgrad", "bulk", "same"),
          ("qkv", "dgrad", "bulk", "half"), ("qkv", "wgrad", "bulk", "same"),
          ("proj", "fprop", "ring_exchange", "same"), ("proj", "fprop", "pipeline", "same"),
          ("proj", "dgrad", "ring_exchange", "half"), ("fc2", "dgrad", "ring_exchange", "half")]


@pytest.mark.parametrize("buffer,pass_name,method,effect", PASSES)
def test_fp8_gathers_move_half_the_bytes_and_reductions_the_same(buffer, pass_name, method,
                                                                  effect):
    """What the schedules issue on the modelled transport, FP8 against bf16: gathers one
    byte per element (hybrid and e4m3 alike), reductions the parameters' dtype; a column
    dgrad gathers its input in bf16 where the wgrad is not FP8; row-wise adds 16 bytes per
    gathered row. The GEMMs issued are the same shapes in every precision."""
    b_p2p, b_coll, b_gemms = _moved(BF16, buffer, pass_name, method)
    moved = b_p2p + b_coll
    assert moved > 0
    half = effect == "half"
    # what a column dgrad gathers is the wgrad's input: FP8 only where the wgrad is
    wgrad_input = buffer in ("qkv", "fc1") and pass_name == "dgrad"
    for num, want in ((HYBRID, moved // 2 if half else moved),
                      (Numerics(fp8="e4m3"), moved // 2 if half else moved),
                      (NO_FP8_WGRAD, moved // 2 if half and not wgrad_input else moved)):
        p2p, coll, gemms = _moved(num, buffer, pass_name, method)
        assert p2p + coll == want, (num.label(), p2p, coll, moved)
        assert gemms == b_gemms
    spec_b = PassSpec(_shapes(BF16)[buffer], pass_name)
    spec_8 = PassSpec(_shapes(HYBRID)[buffer], pass_name)
    assert spec_8.block_bytes == (spec_b.block_bytes // 2 if half else spec_b.block_bytes)
    # row-wise: a gathered row is K values and a 16-byte tail; the column dgrad's gather
    # (for a wgrad in the parameters' dtype) and the reductions stay bf16
    p2p, coll, gemms = _moved(ROWWISE, buffer, pass_name, method)
    width = spec_b.block_elems // (spec_b.shape.m // 4)
    rows = moved // (2 * width)
    assert p2p + coll == (moved // 2 + 16 * rows if half and not wgrad_input else moved)
    assert gemms == b_gemms  # the tails are not multiplied


def test_rs_dgrad_fp8_halves_only_its_input_gather():
    """A column dgrad that reduce-scatters (rs_dgrad) with the input gather beside it: in
    FP8 the gather halves, the reduce-scatter of the bf16 gradient does not."""
    b_p2p, b_coll, _ = _moved(BF16, "fc1", "dgrad", "ring_exchange")
    p2p, coll, _ = _moved(HYBRID, "fc1", "dgrad", "ring_exchange")
    assert b_p2p > 0 and b_coll > 0
    assert (p2p, coll) == (b_p2p, b_coll // 2)


def test_fp8_gemms_take_the_fp8_peak():
    """The roofline of an FP8 GEMM runs at fp8_peak_tflops (twice bf16's by default; a
    --hw field), the wgrad without fp8_wgrad at bf16's; the baseline gather in FP8 is
    shorter, its reduce-scatter not."""
    hw = HW.replace(kernel_us=0.0)
    dims = (8192, 8192, 8192)
    bf, f8 = roofline_us(hw, *dims), roofline_us(hw, *dims, dtype=E4M3)
    assert f8 == pytest.approx(bf * hw.peak_tflops / hw.fp8_peak_tflops)
    assert f8 == pytest.approx(bf / 2, rel=0.01)
    same = hw.replace(**Hardware.parse_overrides(["fp8_peak_tflops=989"]))
    assert roofline_us(same, *dims, dtype=E5M2) == pytest.approx(bf)
    gemm = GemmModel(hw)
    for buffer in ("qkv", "proj"):
        for p in ("fprop", "dgrad", "wgrad"):
            s = LayerSettings.default(f"{buffer}_{p}")
            b = simulate_pass(PassSpec(_shapes(BF16)[buffer], p), s, hw, LAYOUT, gemm)
            f = simulate_pass(PassSpec(_shapes(HYBRID)[buffer], p), s, hw, LAYOUT, gemm)
            n = simulate_pass(PassSpec(_shapes(NO_FP8_WGRAD)[buffer], p), s, hw, LAYOUT, gemm)
            assert f.gemm_us == pytest.approx(b.gemm_us / 2, rel=0.02), (buffer, p)
            assert n.gemm_us == pytest.approx(b.gemm_us if p == "wgrad" else f.gemm_us)
            assert (f.gemm_dtype, n.gemm_dtype) == (
                {"fprop": "e4m3", "dgrad": "e5m2", "wgrad": "e5m2"}[p],
                "bf16" if p == "wgrad" else "e4m3")
            gathers = b.comm == "ag"
            assert f.comm_us < b.comm_us if gathers else f.comm_us == b.comm_us


def test_measured_bf16_gemms_are_not_fp8_times():
    """A calibration's (bf16) GEMM times apply to bf16 GEMMs only: an FP8 GEMM of a measured
    shape is the FP8 roofline with the efficiency fitted to the measurements."""
    cal = Calibration()
    dims = (8192, 4096, 1536, "NT")
    cal.add(dims, 200.0)
    gemm = GemmModel(HW, cal)
    assert gemm.mono_us(*dims) == pytest.approx(200.0)
    f8 = gemm.for_dtype(E4M3)
    assert f8.mono_us(*dims) == pytest.approx(roofline_us(gemm.fitted, *dims[:3], dtype=E4M3))
    assert f8.mono_us(*dims) < 0.6 * 200.0 and f8.source(*dims) == "roofline"
    assert gemm.for_dtype(torch.bfloat16) is gemm and gemm.for_dtype(E4M3) is f8


def test_model_only_picks_move_where_fp8_moves_the_numbers():
    """8B at TP=4: FP8 halves the GEMMs and the gathers but not the reduce-scatters, so some
    passes pick other settings than in bf16 (e.g. fewer pipeline splits where the bf16
    reduce-scatter is now exposed under a GEMM half as long). Where a pick differs, the bf16
    pick is slower in FP8 than the FP8 pick, and the FP8 pick slower in bf16 or equal."""
    gemm = GemmModel(HW)
    bf = simulate(list(_shapes(BF16).values()), HW, LAYOUT)
    f8 = simulate(list(_shapes(HYBRID).values()), HW, LAYOUT)
    differ = []
    for rb, rf in zip(bf.shapes, f8.shapes):
        for p in ("fprop", "dgrad", "wgrad"):
            sb, sf = rb.chosen[p].candidate.settings, rf.chosen[p].candidate.settings
            if sb == sf:
                continue
            differ.append(sb.name)
            in_f8 = [simulate_pass(rf.chosen[p].spec, s, HW, LAYOUT, gemm).overlapped_us
                     for s in (sb, sf)]
            in_bf = [simulate_pass(rb.chosen[p].spec, s, HW, LAYOUT, gemm).overlapped_us
                     for s in (sb, sf)]
            assert in_f8[0] > in_f8[1] and in_bf[0] <= in_bf[1], (sb.name, in_f8, in_bf)
    assert differ, "FP8 and bf16 picked the same settings for every pass"
    assert f8.models[0].best_us < bf.models[0].best_us


def test_fp8_step_estimate_makes_the_weights_once_per_step():
    """A step of 4 micro-batches: every pass at every micro-batch, but the tensorwise FP8
    weights' work (cast and transposed copy, a share of the FP8 work) at the first only:
    the later three save it, from the FP8 layer's times and not from its GEMMs'."""
    shapes = list(_shapes(HYBRID).values())
    r1, r4 = (simulate(shapes, HW, LAYOUT, micro_batches=mb) for mb in (1, 4))
    one, four = r1.models[0].to_dict(), r4.models[0].to_dict()
    per, saved, layers = one["per_layer_ms"], r4.models[0].later_saved_us, r4.models[0].layers
    assert 0 < per["fp8_weights"] < per["fp8_work"]
    assert four["step_ms"]["gemm"] == pytest.approx(4 * one["step_ms"]["gemm"])
    for k in ("baseline", "overlapped", "best"):
        assert saved[k] / 1e3 == pytest.approx(per["fp8_weights"], rel=1e-6)  # none host-bound
        assert four["step_ms"][k] == pytest.approx((4 * per[k] - 3 * saved[k] / 1e3) * layers)


class _Host:
    """A host-time calibration with one figure for every pass, ours and Megatron's."""

    def __init__(self, us: float):
        self.us = us

    def pass_us(self, *args) -> float:
        return self.us

    megatron_pass_us = pass_us


def test_a_host_bound_pass_saves_nothing_at_later_micro_batches():
    """Where the host time per call exceeds the pass's GPU time, the FP8 weights reused at
    a later micro-batch shorten nothing; where it does not, they save their work."""
    shape = _shapes(HYBRID)["fc1"]
    trial = next(t for t in trials(shape, LAYOUT) if t.spec.pass_name == "fprop")
    s = trial.candidate.settings
    free = simulate_pass(trial.spec, s, HW, LAYOUT, GemmModel(HW))
    assert free.fp8_weight_us > 0 and free.later_saved_us == pytest.approx(free.fp8_weight_us)
    assert free.later_saved_base_us == pytest.approx(free.fp8_weight_us)
    bound = simulate_pass(trial.spec, s, HW, LAYOUT,
                          GemmModel(HW, Calibration(host=_Host(10 * free.overlapped_us))))
    assert bound.host_bound and bound.later_saved_us == 0 and bound.later_saved_base_us == 0


def test_eager_fp8_launches_its_kernels_and_exchanges_its_amaxes():
    """Launched from Python (eager), each FP8 kernel costs eager_kernel_us of host time;
    CUDA-graph replays none. A tensorwise pass whose tensor is gathered (a column forward's
    input, a row dgrad's gradient) first exchanges the TP group's amaxes: a small
    collective's latency; no other pass, row-wise or bf16 does."""
    gemm = GemmModel(HW)
    spec = PassSpec(_shapes(HYBRID)["fc1"], "fprop")
    kernels = fp8_work(spec, None, LAYOUT).total.kernels
    for mode, extra in (("eager", 10.0 * kernels), ("graph", 0.0)):
        layout = dataclasses.replace(LAYOUT, mode=mode)
        quiet, loud = (simulate_pass(spec, None, HW.replace(eager_kernel_us=us), layout, gemm)
                       for us in (0.0, 10.0))
        assert loud.baseline_us - quiet.baseline_us == pytest.approx(extra)
    # with a measured host time (of bf16 layers), the launches join that, not the GPU time
    trial = next(t for t in trials(spec.shape, LAYOUT) if t.spec.pass_name == "fprop")
    eager = dataclasses.replace(LAYOUT, mode="eager")
    r = simulate_pass(trial.spec, trial.candidate.settings, HW, eager,
                      GemmModel(HW, Calibration(host=_Host(5.0))))
    calls = fp8_work(trial.spec, trial.candidate.settings, eager).total.kernels
    assert r.host_us == pytest.approx(5.0 + calls * HW.eager_kernel_us)
    kinds = ("fprop", "dgrad", "wgrad")
    gathered = {(b, p) for b in ("qkv", "proj", "fc1", "fc2") for p in kinds
                if amax_exchange_us(PassSpec(_shapes(HYBRID)[b], p), HW, LAYOUT) > 0}
    assert gathered == {("qkv", "fprop"), ("fc1", "fprop"), ("proj", "dgrad"), ("fc2", "dgrad")}
    for num in (BF16, ROWWISE):
        assert all(amax_exchange_us(PassSpec(shape, p), HW, LAYOUT) == 0
                   for shape in _shapes(num).values() for p in kinds)
    # delayed: an exchange after every pass that quantizes (fprop, dgrad), none before a
    # gather's cast; one rank (no group) exchanges nothing
    delayed = {(b, p) for b, shape in _shapes(DELAYED).items() for p in kinds
               if amax_exchange_us(PassSpec(shape, p), HW, LAYOUT) > 0}
    assert delayed == {(b, p) for b in ("qkv", "proj", "fc1", "fc2") for p in ("fprop", "dgrad")}
    # of the amaxes each exchanges: tensorwise one float (a gathered tensor's), delayed a
    # forward's two (input, weight) and a dgrad's one (the gradient)
    from megatron_overlap.simulate.timeline import Engine, Sim
    floats = lambda n: Sim(HW, LAYOUT, Engine("sm", HW.nccl_sms)).collective_us(4 * n)  # noqa: E731
    assert floats(2) > floats(1)
    qkv, proj = _shapes(DELAYED)["qkv"], _shapes(HYBRID)["proj"]
    assert amax_exchange_us(PassSpec(qkv, "fprop"), HW, LAYOUT) == floats(2)
    assert amax_exchange_us(PassSpec(qkv, "dgrad"), HW, LAYOUT) == floats(1)
    assert amax_exchange_us(PassSpec(proj, "dgrad"), HW, LAYOUT) == floats(1)
    one = dataclasses.replace(LAYOUT, tp=1)
    assert all(amax_exchange_us(PassSpec(shape, p), HW, one) == 0
               for shape in _shapes(DELAYED).values() for p in kinds)


def test_delayed_scaling_s_work_differs_from_tensorwise_where_the_layers_do():
    """Delayed scaling casts with a kept scale, reduces the amax in the cast's kernel (the
    tensor read once, not twice: bf16's 2 bytes an element fewer; a zeroing where
    tensorwise has its amax kernel, so as many kernels a tensor) and updates the pass's
    histories after it, with the group's max, in one kernel (where tensorwise's cast takes
    the group's max): per pass, against tensorwise, these bytes fewer and one kernel more
    (tests/test_fp8_work.py holds both to the layers)."""
    for b, shape in _shapes(DELAYED).items():
        tw = _shapes(HYBRID)[b]
        rows = shape.m // shape.tp if shape.column else shape.m  # a forward's input rows
        quantized = {"fprop": rows * shape.k + shape.n * shape.k,  # the input, the weight
                     "dgrad": (shape.m if shape.column else shape.m // shape.tp) * shape.n,
                     "wgrad": 0}
        for p in ("fprop", "dgrad", "wgrad"):
            d, t = fp8_work(PassSpec(shape, p), None, LAYOUT), fp8_work(PassSpec(tw, p), None, LAYOUT)
            assert t.total.bytes - d.total.bytes == 2 * quantized[p], (b, p)
            # one update of the pass's histories after every quantizing pass
            want = {"fprop": 1, "dgrad": 1, "wgrad": 0}[p]
            assert d.total.kernels - t.total.kernels == want, (b, p, d, t)


def test_a_shape_read_back_from_json_keeps_its_precision():
    """The tuner's JSON holds its shapes as dataclasses.asdict (benchmarks/tune_check.py
    reads them back with Shape(**d)); files written before shapes had a precision are bf16."""
    shape = _shapes(ROWWISE)["fc1"]
    back = Shape(**json.loads(json.dumps(dataclasses.asdict(shape))))
    assert back == shape and back.numerics == ROWWISE
    old = {k: v for k, v in dataclasses.asdict(shape).items() if k != "numerics"}
    assert Shape(**old).numerics == BF16


def test_numerics_refuse_what_the_layers_do_not_run():
    for kw, says in ((dict(dtype="fp8"), "parameters' dtype"), (dict(fp8="e5m2"), "hybrid"),
                     (dict(scaling="rowwise"), "needs an FP8 format"),
                     (dict(fp8="hybrid", scaling="rowwise"), "fp8_wgrad off"),
                     (dict(dtype="fp32", fp8="hybrid", scaling="rowwise", fp8_wgrad=False),
                      "bf16 parameters"), (dict(fp8="hybrid", scaling="blockwise"), "scaling")):
        with pytest.raises(ValueError, match=says):
            Numerics(**kw)


# -- the tuner's measured paths in FP8, on CPU ------------------------------------------------

def _fp8_measure_rank(rank, world, fp8, fp8_wgrad):
    from helpers.tune_ranks import fp8_distributed_measure

    return fp8_distributed_measure(rank, world, fp8, fp8_wgrad)


@pytest.mark.parametrize("fp8,fp8_wgrad", [("hybrid", True), ("e4m3", False)])
def test_distributed_measure_times_the_fp8_passes_on_gloo(fp8, fp8_wgrad):
    """The several-GPU hook on two gloo ranks (torch_p2p) with FP8 shapes: every trial's
    overlapped, non-overlapped and compute-only passes run as FP8 trial passes, but the
    wgrad where fp8_wgrad is off; every time is finite and both ranks agree."""
    per_rank = dist.run(_fp8_measure_rank, 2, fp8, fp8_wgrad, timeout=300)
    assert len(per_rank[0]) == len(per_rank[1]) > 0
    for a, b in zip(*per_rank):
        assert a["pass"] == b["pass"] and a["time_ms"] == b["time_ms"]
        for k in ("time_ms", "baseline_ms", "compute_only_ms"):
            assert math.isfinite(a[k]) and a[k] > 0, a
        wgrad_bf16 = a["pass"].endswith("wgrad") and not fp8_wgrad
        assert a["fp8_passes"] == (0 if wgrad_bf16 else 3), a


def test_compute_side_measure_times_fp8_gemms_and_uses_them(monkeypatch):
    """One GPU's mode on CPU (null transport, timers injected, each pass run once): the FP8
    trials' monolithic GEMMs are asked for in their FP8 types (fprop e4m3, dgrad and FP8
    wgrad e5m2), their chunked passes run as FP8 trial passes, and the model takes those times (a
    bulk pass's compute side is the FP8 GEMM's measured time), not bf16's or a roofline."""
    from megatron_overlap.tune import ComputeSideMeasure
    from megatron_overlap.tune import passes as P

    fp8_runs, asked = [], []
    real = P.fp8_trial_pass
    monkeypatch.setattr(P, "fp8_trial_pass",
                        lambda *a, **kw: fp8_runs.append(a[0].name) or real(*a, **kw))
    ms = {E4M3: 0.25, E5M2: 0.3, torch.float32: 0.5}

    def time_gemm(m, k, n, layout, dtype, fast_accum=False):
        asked.append((layout, dtype))
        fast[layout].add(fast_accum)
        return {"mono_graph_ms": ms[dtype], "mono_ms": ms[dtype]}

    def time_pass(fn, m, k, n, layout, dtype, fast_accum=False):
        fast[layout].add(fast_accum)
        fn()
        return {"mono_graph_ms": ms[dtype], "mono_ms": ms[dtype], "sched_graph_ms": ms[dtype],
                "sched_ms": ms[dtype], "host_us_sched": 10.0}

    layout = Layout(tp=2)
    for num, wgrad in ((HYBRID, E5M2), (NO_FP8_WGRAD, torch.float32)):
        fast = collections.defaultdict(set)
        asked.clear()
        fp8_runs.clear()
        measure = ComputeSideMeasure(Hardware(), layout, reps=1, device="cpu",
                                     dtype=torch.float32, time_gemm=time_gemm,
                                     time_pass=time_pass)
        results = {(t.name, t.candidate.settings.method): measure(t)
                   for shape in (Shape("T", "qkv", 32, 32, 48, 2, numerics=num),
                                 Shape("T", "proj", 32, 48, 32, 2, numerics=num))
                   for t in trials(shape, layout)}
        assert ("NT", E4M3) in asked and ("TN", wgrad) in asked
        assert ("NN", E5M2 if num.fp8 == "hybrid" else E4M3) in asked
        # the forward's FP8 GEMMs, whole and chunked, accumulate fast (TE's and torchao's
        # default, install(fp8_fast_accum='fprop')); the dgrad's and wgrad's do not
        assert dict(fast) == {"NT": {True}, "NN": {False}, "TN": {False}}
        # the chunked schedules' passes ran in FP8 (bulk and external ones run one GEMM)
        assert set(fp8_runs) == {"qkv_fprop", "proj_fprop", "proj_dgrad"}
        bulk = results[("qkv_wgrad", "bulk")]
        # the FP8 GEMM's measured time, and the pass's modelled FP8 work (its transposes)
        spec = next(t for t in trials(Shape("T", "qkv", 32, 32, 48, 2, numerics=num), layout)
                    if t.name == "qkv_wgrad" and t.candidate.settings.method == "bulk")
        work = fp8_work(spec.spec, spec.candidate.settings, layout).total.us(Hardware()) / 1e3
        assert (work > 0) == (wgrad == E5M2)  # FP8 wgrad: its operands' transposed copies
        assert bulk["compute_only_ms"] == pytest.approx(ms[wgrad] + work)


# -- the CLI ------------------------------------------------------------------------------------

def test_tune_and_simulate_say_the_precision_they_picked_for(tmp_path, capsys):
    yml = tmp_path / "fp8.yaml"
    assert main(["tune", "--model", "8b", "--tp", "2", "--measure", "model", "--fp8", "hybrid",
                 "--yaml", str(yml), "--wandb", "off", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "Precision: fp8 hybrid tensorwise" in out
    assert yml.read_text().startswith("# picked for precision: fp8 hybrid tensorwise")
    OverlapConfig.load(str(yml))  # still TE ub_cfgs
    search = json.loads((tmp_path / "fp8.yaml.json").read_text())
    assert search["precision"]["fp8"] == "hybrid" and search["precision"]["fp8_wgrad"]
    assert all(t["precision"]["fp8"] == "hybrid" for t in search["trials"])
    assert {r["gemm_dtype"] for r in search["chosen"]} == {"e4m3", "e5m2"}

    js, sy = tmp_path / "s.json", tmp_path / "s.yaml"
    assert main(["simulate", "--shapes", "8b", "--tp", "2", "--fp8", "hybrid", "--fp8-scaling",
                 "rowwise", "--json", str(js), "--yaml", str(sy)]) == 0
    assert "fp8 hybrid rowwise" in capsys.readouterr().out
    meta = json.loads(js.read_text())["meta"]
    assert meta["precision"] == [ROWWISE.to_dict()]
    assert sy.read_text().startswith("# picked for precision: fp8 hybrid rowwise")
    OverlapConfig.load(str(sy))


@pytest.mark.parametrize("argv,says", [
    (["simulate", "--fp8-scaling", "rowwise"], "needs --fp8"),
    (["simulate", "--no-fp8-wgrad"], "needs --fp8"),
    (["simulate", "--fp8", "hybrid", "--fp8-scaling", "rowwise", "--dtype", "fp32"],
     "bf16 parameters"),
    (["simulate", "--fp8", "hybrid", "--hw", "fp8_peak_tflops=0"], "fp8_peak_tflops must be"),
    (["tune", "--fp8", "hybrid", "--fp8-scaling", "rowwise", "--measure", "real"],
     "per-tensor scales only"),
    (["simulate", "--fp8-recipe", "delayed"], "--fp8-recipe needs --fp8"),
    (["simulate", "--fp8", "hybrid", "--fp8-recipe", "delayed", "--fp8-scaling", "rowwise"],
     "not per row"),
])
def test_cli_refuses_fp8_combinations_it_cannot_run(argv, says, capsys, tmp_path):
    target = ["--shapes", "8b"] if argv[0] == "simulate" else [
        "--model", "8b", "--yaml", str(tmp_path / "x.yaml"), "--wandb", "off"]
    assert main([argv[0], "--tp", "2", *target, *argv[1:]]) == 2
    assert says in capsys.readouterr().err


def test_cli_refuses_an_unknown_fp8_format():
    with pytest.raises(SystemExit):
        main(["simulate", "--shapes", "8b", "--tp", "2", "--fp8", "e5m2"])


def test_delayed_scaling_is_simulated_and_timed_as_its_own_precision(capsys, tmp_path):
    """`--fp8-recipe delayed`: the cost model's delayed work (its label in the output and
    the YAML), and the tuner's trial pass runs it (the same FP8 operands and pass as
    tensorwise: what differs is the scales' work, which the model adds)."""
    from megatron_overlap.comm import NullTransport
    from megatron_overlap.tune.passes import precision_of, trial_pass

    sy = tmp_path / "d.yaml"
    assert main(["simulate", "--shapes", "8b", "--tp", "2", "--fp8", "hybrid", "--fp8-recipe",
                 "delayed", "--yaml", str(sy)]) == 0
    assert "fp8 hybrid delayed" in capsys.readouterr().out
    assert sy.read_text().startswith("# picked for precision: fp8 hybrid delayed")
    outs = []
    for num in (HYBRID, DELAYED):
        shape = Shape("T", "qkv", 32, 32, 48, 2, numerics=num)
        t = next(t for t in trials(shape, Layout(tp=2)) if t.spec.pass_name == "fprop")
        timed = trial_pass(t, NullTransport(2), "cpu", torch.bfloat16, precision=precision_of(num))
        timed.run()
        assert timed.tensors["x"].dtype == E4M3
        outs.append(timed.tensors["out"])
    assert outs[0].abs().sum() > 0 and torch.equal(outs[0], outs[1])


def test_trial_pass_refuses_rowwise_naming_the_model():
    from megatron_overlap.comm import NullTransport
    from megatron_overlap.tune.passes import precision_of, trial_pass

    shape = Shape("T", "qkv", 32, 32, 48, 2, numerics=ROWWISE)
    t = trials(shape, Layout(tp=2))[0]
    with pytest.raises(ValueError, match="cost model only"):
        trial_pass(t, NullTransport(2), "cpu", torch.bfloat16, precision=precision_of(ROWWISE))
