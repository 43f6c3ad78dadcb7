"""The cost model (megatron_overlap.simulate): closed-form cases, monotonicity,
hierarchical against flat rings across nodes, calibration, the search space,
and the `megatron-overlap simulate` round trip."""

import dataclasses
import json
import math

import pytest

from megatron_overlap.config import LayerSettings, OverlapConfig
from megatron_overlap.config.settings import allowed_methods
from megatron_overlap.simulate import (
    REFERENCE, PRESETS, Calibration, GemmModel, Hardware, Layout, candidates, layer_passes,
    Shape, parse_shapes, simulate, simulate_pass, trials,
)
from megatron_overlap.simulate.calibration import CalibrationError
from megatron_overlap.simulate.passes import PassSpec
from megatron_overlap.simulate.runs import Run, recorded, run_schedule
from megatron_overlap.overlap import ring_steps

HW = Hardware()
QKV8 = REFERENCE["70B_tp8_qkv"]
PROJ8 = REFERENCE["70B_tp8_proj"]


def _spec(shape, p):
    return PassSpec(shape, p)


def _ring(name, **kw):
    return dataclasses.replace(LayerSettings.default(name, "ring_exchange"), **kw)


def _block_bytes(spec):
    return spec.block_elems * 2  # bf16


# -- closed forms ------------------------------------------------------------------------------

def test_fast_links_hide_all_but_the_tail():
    """Links far faster than the GEMMs: a ring AG or ring RS (copy engines) exposes nothing;
    a pipeline RS exposes its last chunk's reduce-scatter (latency + that chunk's bytes),
    plus what the num_sm SMs its kernels hold cost the chunk GEMMs."""
    hw = HW.replace(nvlink_gbs=1e5, nvlink_latency_us=0.5, nccl_latency_us=1.0, sm_copy_gbs=1e4)
    lay, gemm = Layout(tp=8), GemmModel(hw)
    ag = simulate_pass(_spec(QKV8, "fprop"), _ring("qkv_fprop"), hw, lay, gemm)
    m, k, n = ag.gemm
    assert ag.compute_only_us == pytest.approx(8 * gemm.chunk_us(m, k, n, "NT", 8, "ag_ring"))
    assert ag.overlapped_us == pytest.approx(ag.compute_only_us) and ag.exposed_us == pytest.approx(0)

    rs = simulate_pass(_spec(PROJ8, "fprop"), _ring("proj_fprop"), hw, lay, gemm)
    assert rs.exposed_us == pytest.approx(0, abs=1e-9)

    pipe = LayerSettings.default("proj_fprop", "pipeline")  # 4 splits, 16 SMs
    spec = _spec(PROJ8, "fprop")
    got = simulate_pass(spec, pipe, hw, lay, gemm)
    bw = min(hw.nvlink_gbs, pipe.num_sm * hw.sm_copy_gbs) * 1e3
    last_rs = hw.nccl_latency_us + 7 * _block_bytes(spec) / 4 / bw
    ops = spec.gemm_layout
    held = 4 * (gemm.chunk_us(*spec.gemm, ops, 4, "rs_pipeline", sms=hw.sms - pipe.num_sm)
                - gemm.chunk_us(*spec.gemm, ops, 4, "rs_pipeline"))
    assert held > 0
    assert got.exposed_us == pytest.approx(last_rs + held)


def test_slow_links_are_comm_bound_with_the_gemm_hidden():
    """Links far slower than the GEMMs: ring AG time = (W-1) transfers + the last chunk's
    GEMM; everything else of the GEMM hides under the transfers."""
    hw = HW.replace(nvlink_gbs=2.0)
    lay, gemm = Layout(tp=8), GemmModel(hw)
    spec = _spec(QKV8, "fprop")
    got = simulate_pass(spec, _ring("qkv_fprop"), hw, lay, gemm)
    step = hw.nvlink_latency_us + _block_bytes(spec) / (hw.nvlink_gbs * 1e3)
    chunk = gemm.chunk_us(*spec.gemm, spec.gemm_layout, 8, "ag_ring")
    assert got.overlapped_us == pytest.approx(7 * step + chunk)
    assert got.overlapped_us > 20 * got.compute_only_us
    # the non-overlapped path pays the GEMM, then the collective
    assert got.baseline_us == pytest.approx(got.gemm_us + got.comm_us)
    assert got.comm_us == pytest.approx(hw.nccl_latency_us + 7 * _block_bytes(spec) / 2e3)


def test_aggregate_halves_the_latency_bound_steps():
    """Tiny blocks, large latency: pairs take W/2 transfers (the partner's block, then
    W/2 - 1 pairs) instead of W-1."""
    hw = HW.replace(nvlink_latency_us=500.0)
    lay, gemm = Layout(tp=8), GemmModel(hw)
    shape = dataclasses.replace(QKV8, m=64, k=64, n=64)
    one = simulate_pass(_spec(shape, "fprop"), _ring("qkv_fprop"), hw, lay, gemm)
    two = simulate_pass(_spec(shape, "fprop"), _ring("qkv_fprop", aggregate=True), hw, lay, gemm)
    assert one.overlapped_us == pytest.approx(7 * 500, rel=0.01)
    assert two.overlapped_us == pytest.approx(4 * 500, rel=0.01)


def test_one_rank_has_no_communication():
    lay = Layout(tp=1, gpus_per_node=8)
    report = simulate(parse_shapes("70b", 1), HW, lay)
    for sr in report.shapes:
        for r in sr.given + sr.best:
            assert r.comm_us == 0 and r.exposed_us == 0
            assert r.overlapped_us == r.baseline_us == r.compute_only_us == r.gemm_us


def test_hierarchical_beats_a_flat_ring_across_nodes():
    """TP=16 over 2 nodes: a flat ring waits on the IB hop every step; the hierarchical
    order sends over IB once, under the intra-node ring."""
    lay, gemm = Layout(tp=16, gpus_per_node=8), GemmModel(HW)
    for shape in parse_shapes("70b", 16):
        for spec in layer_passes(shape):
            if "ring_exchange" not in allowed_methods(spec.name) or spec.name.startswith(
                    ("qkv_dgrad", "fc1_dgrad")):
                continue
            flat = simulate_pass(spec, _ring(spec.name, ring_order="flat"), HW, lay, gemm)
            hier = simulate_pass(spec, _ring(spec.name, ring_order="hierarchical"), HW, lay, gemm)
            auto = simulate_pass(spec, _ring(spec.name), HW, lay, gemm)  # TE default: auto
            assert (flat.ring_order, hier.ring_order, auto.ring_order) == (
                "flat", "hierarchical", "hierarchical")
            assert auto.overlapped_us == hier.overlapped_us
            ib_step = _block_bytes(spec) / (HW.ib_gbs * 1e3)
            # a ring all-gather forwards: every step pays the IB hop; the ring reduce-scatter
            # sends each partial straight to its owner: the other node's 8 cross IB
            hops = 8 if spec.comm == "rs" else 15
            assert flat.overlapped_us >= hops * ib_step, spec.name
            assert hier.overlapped_us < 0.5 * flat.overlapped_us, spec.name
            if spec.comm == "rs":  # the flat one's single sum reads less than the adds
                assert flat.compute_only_us < hier.compute_only_us, spec.name
            else:
                assert hier.compute_only_us == pytest.approx(flat.compute_only_us, rel=0.05)
    # one node: the order changes nothing
    one = Layout(tp=8)
    spec = _spec(QKV8, "fprop")
    flat = simulate_pass(spec, _ring("qkv_fprop", ring_order="flat"), HW, one, gemm)
    hier = simulate_pass(spec, _ring("qkv_fprop", ring_order="hierarchical"), HW, one, gemm)
    assert flat.overlapped_us == hier.overlapped_us and hier.ring_order == "flat"


def test_hierarchical_ties_flat_when_ib_is_as_fast_as_nvlink():
    hw = HW.replace(ib_gbs=HW.nvlink_gbs, ib_latency_us=HW.nvlink_latency_us)
    lay, gemm = Layout(tp=16, gpus_per_node=8), GemmModel(hw)
    spec = _spec(REFERENCE["70B_tp8_fc1"].at_tp(16), "fprop")
    flat = simulate_pass(spec, _ring("fc1_fprop", ring_order="flat"), hw, lay, gemm)
    hier = simulate_pass(spec, _ring("fc1_fprop", ring_order="hierarchical"), hw, lay, gemm)
    assert hier.overlapped_us == pytest.approx(flat.overlapped_us, rel=0.05)


# -- monotonicity ------------------------------------------------------------------------------

SETTINGS = [("qkv_fprop", "ring_exchange"), ("proj_fprop", "pipeline"), ("proj_fprop", "ring_exchange"),
            ("qkv_dgrad", "bulk"), ("qkv_wgrad", "bulk"), ("proj_dgrad", "ring_exchange")]


@pytest.mark.parametrize("tp,gpn,order", [(8, 8, "flat"), (16, 8, "flat"), (16, 8, "hierarchical")])
def test_monotone_in_bandwidth_latency_and_tokens(tp, gpn, order):
    lay = Layout(tp=tp, gpus_per_node=gpn)
    for name, method in SETTINGS:
        s = dataclasses.replace(LayerSettings.default(name, method), ring_order=order)
        buffer, p = name.split("_")
        base = REFERENCE[f"70B_tp8_{buffer}"].at_tp(tp)

        def t(hw=HW, m=base.m):
            shape = dataclasses.replace(base, m=m)
            r = simulate_pass(PassSpec(shape, p), s, hw, lay, GemmModel(hw))
            assert r.compute_only_us <= r.overlapped_us + 1e-9
            return r

        def check(values, series, increasing):
            got = [series(v) for v in values]
            for a, b in zip(got, got[1:]):
                assert (b >= a - 1e-9) if increasing else (b <= a + 1e-9), (name, values, got)

        check([50, 100, 200, 400, 800], lambda v: t(HW.replace(nvlink_gbs=v)).overlapped_us, False)
        check([10, 25, 45, 90], lambda v: t(HW.replace(ib_gbs=v)).overlapped_us, False)
        check([0, 3, 10, 30], lambda v: t(HW.replace(nvlink_latency_us=v)).overlapped_us, True)
        check([50, 100, 200, 400, 800], lambda v: t(HW.replace(nvlink_gbs=v)).baseline_us, False)
        check([2048, 4096, 8192, 16384], lambda v: t(m=v).overlapped_us, True)
        check([2048, 4096, 8192, 16384], lambda v: t(m=v).baseline_us, True)


def test_eager_launches_cost_host_time():
    lay_g, lay_e = Layout(tp=8, mode="graph"), Layout(tp=8, mode="eager")
    gemm, spec = GemmModel(HW), _spec(REFERENCE["8B_tp2_qkv"].at_tp(8), "fprop")
    graph = simulate_pass(spec, _ring("qkv_fprop"), HW, lay_g, gemm)
    eager = simulate_pass(spec, _ring("qkv_fprop"), HW, lay_e, gemm)
    assert eager.compute_only_us > graph.compute_only_us
    # small chunks: the host is the bound, one step's launch cost per chunk
    assert eager.compute_only_us >= 8 * HW.eager_step_us


# -- calibration -------------------------------------------------------------------------------

def _calibration_file(tmp_path):
    rows = [{"shape": "70B_tp8_qkv", "m": 8192, "k": 8192, "n": 1280, "op": "ag", "tp": 8,
             "schedule": "ring", "chunks": 8, "gemm_streams": 1, "mono_ms": 0.31, "sched_ms": 0.6,
             "mono_graph_ms": 0.3, "sched_graph_ms": 0.4, "host_us_sched": 800.0},
            {"shape": "70B_tp8_qkv", "m": 8192, "k": 8192, "n": 1280, "op": "ag", "tp": 8,
             "schedule": "ring/2s", "chunks": 8, "gemm_streams": 2, "mono_ms": 0.31,
             "sched_ms": 0.5, "mono_graph_ms": 0.3, "sched_graph_ms": 0.9, "host_us_sched": 1.0}]
    path = tmp_path / "compute_side.json"
    path.write_text(json.dumps({"meta": {"device": "NVIDIA H200"}, "rows": rows, "runs": [rows]}))
    return path


def test_a_ring_reduce_scatter_s_measured_reduction_follows_the_file(tmp_path):
    """A measured ring reduce-scatter's time holds its reduction, taken out before its GEMMs
    are shared: the one sum of the TP partials where the file says it timed that ring
    (compute_side.py's meta `ring_rs: sum`, and the tuner's own measurements), TP - 1
    running-sum adds in a file from before it (no `ring_rs`); a value it does not know is
    an error naming the file."""
    path = _calibration_file(tmp_path)
    legacy = Calibration.load(path)
    doc = json.loads(path.read_text())
    doc["meta"]["ring_rs"] = "sum"
    path.write_text(json.dumps(doc))
    new = Calibration.load(path)
    assert (legacy.ring_rs, new.ring_rs, Calibration().ring_rs) == ("adds", "sum", "sum")
    block = 1024 * 8192 * 2
    old_g, new_g = GemmModel(HW, legacy), GemmModel(HW, new)
    assert old_g.ring_rs_extra_us(8, block) == pytest.approx(7 * old_g.mem_us(3 * block))
    assert new_g.ring_rs_extra_us(8, block) == pytest.approx(new_g.mem_us(9 * block))
    assert old_g.ring_rs_extra_us(8, block) > 2 * new_g.ring_rs_extra_us(8, block)
    # the tuner's cache keys on it (a file re-measured at the same path predicts anew), the
    # model for another dtype keeps it, the report says it
    from megatron_overlap.tune.hooks import ModelMeasure
    keys = [ModelMeasure(HW, Layout(tp=8), c).hardware for c in (legacy, new)]
    assert keys[0]["calibration"] == keys[1]["calibration"] and keys[0] != keys[1]
    import torch
    assert old_g.for_dtype(torch.float8_e4m3fn).calibration.ring_rs == "adds"
    report = simulate(parse_shapes("70b", 8), HW, Layout(tp=8), calibration=legacy)
    from megatron_overlap.simulate.report import to_json
    assert to_json(report, "x")["meta"]["calibration_ring_rs"] == "adds"
    doc["meta"]["ring_rs"] = "tree"
    path.write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match="compute_side.json.*'ring_rs' is 'tree'"):
        Calibration.load(path)


def test_calibration_drives_gemm_times(tmp_path):
    cal = Calibration.load(_calibration_file(tmp_path))
    gemm = GemmModel(HW, cal)
    assert gemm.mono_us(8192, 8192, 1280, "NT") == pytest.approx(300)
    assert gemm.chunk_us(8192, 8192, 1280, "NT", 8, "ag_ring") == pytest.approx(50)  # 1-stream row
    # an aggregate ring's pair GEMM: the same measured ring, shared by rows
    assert gemm.chunk_us(8192, 8192, 1280, "NT", 8, "ag_ring", rows=2048) == pytest.approx(100)
    assert cal.eager_step_us() == pytest.approx(100)
    # the fitted roofline reproduces the one measured shape, and is used for the others
    from megatron_overlap.simulate.gemm import roofline_us
    assert roofline_us(gemm.fitted, 8192, 8192, 1280) == pytest.approx(300)
    assert gemm.source(8192, 1280, 8192, "NT") == "roofline"
    got = simulate_pass(_spec(QKV8, "fprop"), _ring("qkv_fprop"), HW, Layout(tp=8), gemm)
    assert got.compute_only_us == pytest.approx(400)  # the measured graphed schedule
    assert got.gemm_us == pytest.approx(300) and got.gemm_source == "measured"
    eager = simulate_pass(_spec(QKV8, "fprop"), _ring("qkv_fprop"), HW, Layout(tp=8, mode="eager"),
                          gemm)
    assert eager.compute_only_us == pytest.approx(600)  # the measured eager schedule
    # a shape the calibration lacks: roofline chunks, the measured host cost per step
    other = simulate_pass(_spec(QKV8, "dgrad"), LayerSettings.default("qkv_dgrad"), HW,
                          Layout(tp=8, mode="eager"), gemm)
    assert other.gemm_source == "roofline"
    row = PassSpec(REFERENCE["70B_tp8_proj"], "dgrad")  # a ring AG over an uncalibrated GEMM
    small = dataclasses.replace(row.shape, m=1024)
    host = simulate_pass(PassSpec(small, "dgrad"), _ring("proj_dgrad"), HW,
                         Layout(tp=8, mode="eager"), gemm)
    assert host.compute_only_us >= 8 * 100  # host-bound at 100 us a step


# -- shapes, search space ----------------------------------------------------------------------

def test_presets_reproduce_the_reference_shapes():
    ref = {(s.model, s.buffer, s.tp): (s.m, s.k, s.n) for s in REFERENCE.values()}
    for s in PRESETS["70b"].shapes("70B", 8):
        assert (s.m, s.k, s.n) == ref[("70B", s.buffer, 8)]
    by = {s.buffer: s for s in PRESETS["8b"].shapes("8B", 4)}
    assert (by["fc1"].m, by["fc1"].k, by["fc1"].n) == ref[("8B", "fc1", 4)]
    assert (by["fc2"].m, by["fc2"].k, by["fc2"].n) == ref[("8B", "fc2", 4)]
    qkv = dataclasses.replace(PRESETS["8b"], seq_length=4096).shapes("8B", 2)[0]
    assert (qkv.m, qkv.k, qkv.n) == ref[("8B", "qkv", 2)]
    s16 = {s.buffer: s for s in parse_shapes("70b", 16)}
    assert (s16["qkv"].n, s16["fc1"].n, s16["proj"].k, s16["fc2"].k) == (640, 3584, 512, 1792)
    recut = REFERENCE["70B_tp8_qkv"].at_tp(16)
    assert (recut.m, recut.k, recut.n, recut.tp) == (8192, 8192, 640, 16)
    assert "re-cut" in recut.source
    with pytest.raises(ValueError, match="not `reference`"):
        parse_shapes("nope", 8)


# -- the model runs the schedule code ----------------------------------------------------------

def _small_runs():
    """One Run per schedule the layers call, on small shapes: TP=4 (2 nodes x 2 for the
    hierarchical orders), 64 tokens."""
    def run(name, schedule, method, comm, **kw):
        spec = dict(tp=4, local=2 if schedule.endswith("hier") else 4, gemm=(64, 8, 12),
                    block=(16, 8))
        return Run(name, schedule, method, comm, **{**spec, **kw})
    return [run("qkv_fprop", "ag_ring", "ring_exchange", "ag"),
            run("qkv_fprop", "ag_ring", "ring_exchange", "ag", aggregate=True),
            run("qkv_fprop", "ag_hier", "ring_exchange", "ag"),
            run("proj_fprop", "rs_ring", "ring_exchange", "rs"),
            run("proj_fprop", "rs_pipeline", "pipeline", "rs", splits=2),
            run("proj_fprop", "rs_hier", "pipeline", "rs"),
            run("qkv_dgrad", "rs_pipeline", "pipeline", "ag", splits=4, gather=True),
            run("qkv_dgrad", "bulk", "bulk", "ag"),
            run("qkv_wgrad", "bulk", "bulk", "rs")]


def test_the_model_issues_what_the_schedules_issue_on_a_real_transport():
    """Every rank's recorded launches, transfers and waits (comm.trace) on the modelled
    transport are the same, in order, as the same schedule's on the null transport with
    real tensors and cuBLAS/BLAS GEMMs; the Sim times one transfer per send and one per
    collective; nothing reaches the per-op stats."""
    from megatron_overlap.comm import stats, trace
    from megatron_overlap.comm.null import NullTransport
    from megatron_overlap.simulate.play import Costs, play
    from megatron_overlap.simulate.timeline import Engine, Sim
    from megatron_overlap.simulate.transport import record

    for run in _small_runs():
        real = []
        for rank in range(run.tp):
            with trace.recording() as events:
                run_schedule(run, NullTransport(run.tp, rank), device="cpu")
            real.append([(e.kind, e.op, e.chunk) for e in events])
        before = stats.snapshot(reset=False)
        modelled = []

        def body(tp, gemm):
            with trace.recording() as events:
                run_schedule(run, tp, gemm)
            modelled.append([(e.kind, e.op, e.chunk) for e in events])
        traces = record(body, run.tp)
        assert stats.snapshot(reset=False) == before, run
        assert modelled == real and any(e[0] == "start" for e in real[0]), run
        assert traces == [list(t) for t in recorded(run)]
        kinds = [e[0] for t in traces for e in t]
        assert kinds.count("gemm") == sum(e[0] == "gemm" for t in real for e in t), run
        sim = Sim(HW, Layout(tp=run.tp, gpus_per_node=run.local), Engine())
        play(sim, traces, Costs(lambda *_: 1.0, 0.0, lambda _: 0.5))
        sends = sum(len(e[2]) for t in traces for e in t if e[0] == "exchange")
        assert sim.transfers == sends + kinds.count("collective") // run.tp, run
        assert sim.end() >= kinds.count("gemm") // run.tp * 1.0, run


def test_a_schedule_change_in_overlap_is_seen_by_the_model(monkeypatch):
    """Swap overlap's ring AG->GEMM for its gather-then-GEMM: the modelled pass becomes the
    collective followed by one whole GEMM, which it can only be if the model runs
    overlap's code."""
    from megatron_overlap.overlap import ag_gemm
    from megatron_overlap.simulate.timeline import Engine, Sim

    spec, s, lay, gemm = _spec(QKV8, "fprop"), _ring("qkv_fprop"), Layout(tp=8), GemmModel(HW)
    ring = simulate_pass(spec, s, HW, lay, gemm)
    recorded.cache_clear()
    monkeypatch.setattr(ag_gemm, "ring_exchange",
                        lambda x, w, tp, *, op, aggregate, streams, out, gemm:
                        ag_gemm.bulk(x, w, tp, op=op, out=out, gemm=gemm))
    try:
        serial = simulate_pass(spec, s, HW, lay, gemm)
    finally:
        recorded.cache_clear()
    coll = Sim(HW, lay, Engine()).collective_us(_block_bytes(spec))
    assert serial.overlapped_us == pytest.approx(coll + gemm.mono_us(*spec.gemm, spec.gemm_layout))
    assert serial.compute_only_us == pytest.approx(gemm.mono_us(*spec.gemm, spec.gemm_layout))
    assert ring.overlapped_us < serial.overlapped_us - 0.5 * coll


def test_a_deadlock_or_untimed_work_is_a_clear_error():
    from megatron_overlap.simulate.play import Costs, play
    from megatron_overlap.simulate.timeline import Engine, Sim
    from megatron_overlap.simulate.transport import meta_empty, record

    # rank 0 waits for a block from rank 1, which never sends it
    traces = [[("exchange", 1, (), ((1, (0, 0, 8)),)), ("wait", 1)], []]
    with pytest.raises(RuntimeError, match="rank 0 at .*deadlocks"):
        play(Sim(HW, Layout(tp=2), Engine()), traces, Costs(lambda *_: 1.0, 0.0, lambda _: 0.5))
    with pytest.raises(NotImplementedError, match="mul_.*no time for"):
        record(lambda tp, gemm: meta_empty(4).mul_(2), 1)


def test_ring_steps_and_node_pairing_are_what_the_model_assumes():
    """The model takes its orders from the overlap code; these are the properties its
    step counts rely on."""
    from megatron_overlap.overlap.hierarchical import partners

    for world in range(1, 10):
        for rank in range(world):
            one = ring_steps(rank, world, False)
            both = ring_steps(rank, world, True) if world <= 2 or world % 2 == 0 else None
            for steps in (one, both) if both else (one,):
                assert sorted(b for s in steps for b in s) == list(range(world))
                assert steps[0] == [rank]
                assert all(s == list(range(s[0], s[0] + len(s))) for s in steps)  # adjacent
            assert len(one) == world
            if both:
                assert len(both) == world // 2 + 1 if world > 1 else len(both) == 1
                assert [len(s) for s in both] == [1] * min(world, 2) + [2] * (len(both) - 2)
            else:
                with pytest.raises(ValueError, match="odd"):
                    ring_steps(rank, world, True)
        for node in range(world):
            assert sorted(partners(node, world)) == [n for n in range(world) if n != node]
        for r in range(max(world - 1 + world % 2, 0)):  # mutual in every round
            for node in range(world):
                ps = partners(node, world)
                if r < len(ps):
                    assert node in partners(ps[r], world)


@pytest.mark.parametrize("backend", ["symm", "nvshmem", "torch_p2p"])
@pytest.mark.parametrize("nodes", [1, 2])
def test_candidates_are_valid_distinct_and_effective(backend, nodes):
    lay = Layout(tp=8 * nodes, gpus_per_node=8, backend=backend)
    for rs_dgrad in (False, True):
        for name in ("qkv_fprop", "qkv_dgrad", "qkv_wgrad", "proj_fprop", "proj_dgrad",
                     "proj_wgrad", "fc1_dgrad"):
            cands = candidates(name, lay, rows_per_rank=96, rs_dgrad=rs_dgrad)
            assert cands and len(set(cands)) == len(cands), name
            for c in cands:
                s = c.settings
                assert LayerSettings(**dataclasses.asdict(s)) == s  # passes validation again
                if s.method == "pipeline":
                    assert 96 % s.num_splits == 0
                if name in ("qkv_dgrad", "fc1_dgrad") and not rs_dgrad:
                    assert s.method == "bulk"
                assert s.ring_order == "auto" or (nodes > 1 and s.ring_order == "flat")
                if nodes > 1 and c.ring_order == "hierarchical":  # overlap.hierarchical:
                    assert not s.aggregate  # one direction, and no pipeline chunks
                    assert s.method != "pipeline" or s.num_splits == 4
                # keys that do nothing on this backend stay at TE's default (aggregate's:
                # false; candidates never carry our "auto", which each pass resolves)
                default = LayerSettings.te_default(name, s.method)
                assert s.aggregate in (False, True), (name, s.aggregate)
                for key in ("use_ce", "num_sm", "aggregate"):
                    if s.effects(backend)[key] != "active":
                        assert getattr(s, key) == getattr(default, key), (name, key)
            methods = {c.settings.method for c in cands}
            if rs_dgrad and name == "qkv_dgrad":
                assert methods == {"bulk", "pipeline", "ring_exchange"}
            if name == "proj_wgrad":
                assert [c.settings.method for c in cands] == ["external"]
    ring = [c.settings for c in candidates("qkv_fprop", lay, 96)]
    ce_matters = LayerSettings.default("qkv_fprop").effects(backend)["use_ce"] == "active"
    assert len({s.use_ce for s in ring}) == (2 if ce_matters else 1)
    assert {s.aggregate for s in ring} == {False, True}


def test_picked_settings_form_a_valid_config(tmp_path):
    lay = Layout(tp=16, gpus_per_node=8, backend="nvshmem")
    report = simulate(parse_shapes("70b", 16), HW, lay, rs_dgrad=True)
    (model,) = report.models
    cfg = report.picked_config(model.model)
    path = tmp_path / "picked.yaml"
    cfg.to_yaml(path)
    loaded = OverlapConfig.load(str(path))
    assert loaded == cfg
    for sr in report.shapes:
        given = {r.name: r for r in sr.given}
        for p, t in sr.chosen.items():
            if not t.comm_moved:
                assert loaded[t.name] == t.candidate.settings
            assert sr.best[("fprop", "dgrad", "wgrad").index(p)].overlapped_us <= \
                given[t.name].overlapped_us + 1e-9  # the defaults are among the candidates
        if sr.chosen["dgrad"].candidate.settings.is_reduce_scatter and sr.shape.column:
            assert sr.chosen["wgrad"].comm_moved
            assert f"{sr.shape.buffer}_wgrad" in loaded.unused_layers
    assert set(model.ring_orders.values()) <= {"flat", "hierarchical"}
    assert model.best_us <= model.given_us <= model.baseline_us


def test_trials_cover_every_pass():
    got = trials(REFERENCE["70B_tp8_fc1"], Layout(tp=8), rs_dgrad=True)
    assert {t.name for t in got} == {"fc1_fprop", "fc1_dgrad", "fc1_wgrad"}
    assert sum(t.comm_moved for t in got) == 1


# -- CLI ---------------------------------------------------------------------------------------

def test_cli_round_trip(tmp_path, capsys):
    from megatron_overlap.cli import main

    cfg = tmp_path / "in.yaml"
    cfg.write_text("proj_fprop:\n  method: pipeline\n  num_splits: 2\n")
    out, yml, md = tmp_path / "out.json", tmp_path / "picked.yaml", tmp_path / "out.md"
    argv = ["simulate", "--shapes", "70b", "--tp", "8", "--gpus-per-node", "8", "--cfg", str(cfg),
            "--json", str(out), "--yaml", str(yml), "--md", str(md), "--hw", "ib_gbs=40"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    for word in ("GEMM ms", "non-overlapped ms", "overlapped ms", "exposed ms", "hidden",
                 "best settings", "70B_tp8_qkv", "per layer"):
        assert word in printed
    data = json.loads(out.read_text())
    assert data["command"] == "megatron-overlap " + " ".join(argv)
    assert data["meta"]["hardware"]["ib_gbs"] == 40
    assert data["meta"]["gemm_times"].startswith("roofline")
    passes = {p["name"]: p for p in data["passes"]}
    assert len(passes) == 12
    assert passes["proj_fprop"]["settings"]["num_splits"] == 2
    direct = simulate(parse_shapes("70b", 8), HW.replace(ib_gbs=40), Layout(tp=8),
                      cfg=OverlapConfig.load(str(cfg)))
    for sr in direct.shapes:
        for r in sr.given:
            assert passes[r.name]["overlapped_ms"] == pytest.approx(r.overlapped_us / 1e3)
            assert passes[r.name]["baseline_ms"] == pytest.approx(r.baseline_us / 1e3)
    for p in passes.values():
        assert p["best"]["overlapped_ms"] <= p["overlapped_ms"] + 1e-12
        assert p["compute_only_ms"] <= p["overlapped_ms"] + 1e-12
        h = p["hidden_fraction"]
        assert h is None or math.isfinite(h)
    (model,) = data["models"]
    assert model["complete"] and model["layers"] == 80
    assert OverlapConfig.load(str(yml)) == OverlapConfig.load(model["picked_ub_cfgs"])
    assert md.read_text().startswith(f"Command: `{data['command']}`")
    assert main(["simulate", "--shapes", "bogus", "--tp", "8"]) == 2


# -- measured host time (benchmarks/host_time.py's file) -----------------------------------------

def _host_file(tmp_path, fwd_us, bwd_us=None, tps=(2, 8)):
    """A synthetic host_time.py JSON: every layer at the same host time, eager and replayed."""
    per = {"fwd_us": 1.0, "bwd_us": 1.0, "fwd_b2b_us": fwd_us,
           "bwd_b2b_us": fwd_us if bwd_us is None else bwd_us}
    layers = {b: dict(per) for b in ("qkv", "proj", "fc1", "fc2")}
    rows = [{"tp": tp, "eager": layers, "replay": {b: {**v, "fwd_b2b_us": v["fwd_b2b_us"] * tp / 8}
                                                   for b, v in layers.items()}} for tp in tps]
    path = tmp_path / "host_time.json"
    path.write_text(json.dumps({"meta": {"backend": "symm"}, "rows": rows}))
    return str(path)


def test_host_time_file_is_read_per_pass_mode_and_tp(tmp_path):
    from megatron_overlap.simulate.host import HostTime

    host = HostTime.load(_host_file(tmp_path, 800.0, 400.0))
    assert host.pass_us("qkv", "fprop", 8, "eager") == 800.0
    assert host.pass_us("qkv", "dgrad", 8, "eager") == 200.0  # half the backward call
    assert host.pass_us("qkv", "fprop", 8, "graph") == 800.0  # the replayed rows
    assert host.pass_us("qkv", "fprop", 2, "graph") == 200.0
    assert host.pass_us("qkv", "fprop", 4, "graph") == pytest.approx(400.0)  # between 2 and 8
    assert host.pass_us("qkv", "fprop", 16, "graph") == 800.0  # the nearest beyond
    assert host.pass_us("attn", "fprop", 8, "graph") is None
    assert host.pass_us("proj", "dgrad", 8, "eager", column=False) == 400.0  # all on the dgrad
    assert host.pass_us("proj", "wgrad", 8, "eager", column=False) is None  # the GEMM alone
    assert "TP 2/8" in host.describe("graph") and "replay" in host.describe("graph")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": [{"tp": 2, "eager": {"qkv": {"fwd_b2b_us": -1}}}]}))
    with pytest.raises(ValueError, match="fwd_b2b_us"):
        HostTime.load(bad)


def test_an_old_host_time_file_takes_its_back_to_back_figures(tmp_path):
    """A file from before the turns and the chain (no *_staggered_us, no chain_*): the per-layer
    back-to-back figures, and Megatron's path stays modelled, saying so."""
    from megatron_overlap.simulate.host import HostTime

    host = HostTime.load(_host_file(tmp_path, 800.0, 400.0))
    assert host.sources("graph") == {"ours": {2: "layer_b2b", 8: "layer_b2b"}, "megatron": {}}
    assert host.megatron_pass_us("fprop", 8, "graph") is None
    text = host.describe("eager", 60.0)
    assert "each linear alone, all ranks at once" in text
    assert "Megatron's path: modelled 60 us" in text and "no chain_megatron" in text


# per layer: fwd figure (bwd twice it), back to back and staggered; the chain's per-linear figures
LAYER_B2B = {"qkv": 100.0, "proj": 200.0, "fc1": 300.0, "fc2": 400.0}  # sum 1000
LAYER_STG = {"qkv": 10.0, "proj": 20.0, "fc1": 30.0, "fc2": 40.0}  # sum 100


def _host_file_v2(tmp_path, chain=True, staggered=True, megatron=(30.0, 40.0, 15.0, 20.0),
                  tps=(2, 8), name="host_time_v2.json"):
    """A host_time.py JSON of this session's format: per-layer b2b figures in both modes,
    staggered ones on the replayed rows only (as on the GPU), the chains (ours replayed:
    staggered and concurrent; eager: concurrent only) and chain_megatron (fwd, bwd
    concurrent; fwd, bwd staggered; None: absent)."""
    def layers(stg):
        return {b: {"fwd_us": 1.0, "bwd_us": 1.0, "fwd_b2b_us": v, "bwd_b2b_us": 2 * v,
                    "fwd_staggered_us": LAYER_STG[b] if stg else None,
                    "bwd_staggered_us": 2 * LAYER_STG[b] if stg else None}
                for b, v in LAYER_B2B.items()}

    def ways(conc, stg):
        return {"concurrent": {"fwd_us": conc[0], "bwd_us": conc[1]},
                "staggered": {"fwd_us": stg[0], "bwd_us": stg[1]}}

    rows = []
    for tp in tps:
        row = {"tp": tp, "eager": layers(False), "replay": layers(staggered)}
        if chain:
            row["chain_eager"] = ways((500.0, 1000.0), (None, None))
            row["chain_replay"] = ways((80.0, 160.0), (50.0, 100.0) if staggered else (None, None))
        if megatron is not None:
            row["chain_megatron"] = ways(megatron[:2], megatron[2:])
        rows.append(row)
    path = tmp_path / name
    path.write_text(json.dumps({"meta": {"backend": "symm"}, "rows": rows}))
    return str(path)


def test_host_time_takes_the_chain_staggered_and_megatrons_measured_path(tmp_path):
    """This session's file: replayed rows from the chain one rank at a time, its total split by
    the per-layer staggered figures; eager rows from the chain with every rank at once (no
    turns of eager calls), split by the back-to-back figures; Megatron's path from
    chain_megatron, taken the same way as ours (staggered / concurrent), the same split."""
    from megatron_overlap.simulate.host import HostTime

    host = HostTime.load(_host_file_v2(tmp_path))
    # graph: chain staggered, fwd 50 per linear -> 200 per layer, split 10:20:30:40
    for b, w in LAYER_STG.items():
        assert host.pass_us(b, "fprop", 8, "graph") == pytest.approx(200 * w / 100)
    assert host.pass_us("qkv", "dgrad", 8, "graph") == pytest.approx(400 * 20 / 200 / 2)
    assert host.pass_us("qkv", "wgrad", 8, "graph") == pytest.approx(400 * 20 / 200 / 2)
    assert host.pass_us("proj", "dgrad", 2, "graph", column=False) == pytest.approx(400 * 40 / 200)
    assert host.pass_us("proj", "wgrad", 2, "graph", column=False) is None
    # eager: chain concurrent, fwd 500 per linear -> 2000 per layer, split 100:200:300:400
    for b, w in LAYER_B2B.items():
        assert host.pass_us(b, "fprop", 4, "eager") == pytest.approx(2000 * w / 1000)
    assert host.pass_us("fc2", "dgrad", 8, "eager", column=False) == pytest.approx(4000 * 0.4)
    assert host.sources("graph") == {"ours": {2: "chain_staggered", 8: "chain_staggered"},
                                     "megatron": {2: "chain_staggered", 8: "chain_staggered"}}
    assert host.sources("eager") == {"ours": {2: "chain_concurrent", 8: "chain_concurrent"},
                                     "megatron": {2: "chain_concurrent", 8: "chain_concurrent"}}
    # Megatron's: staggered beside our staggered figures, concurrent beside concurrent ones
    assert host.megatron_pass_us("fprop", 8, "graph") == 15.0
    assert host.megatron_pass_us("dgrad", 8, "graph") == 10.0  # column: half the backward
    assert host.megatron_pass_us("dgrad", 8, "graph", column=False) == 20.0
    assert host.megatron_pass_us("wgrad", 8, "graph", column=False) is None
    assert host.megatron_pass_us("fprop", 2, "eager") == 30.0
    assert host.megatron_pass_us("wgrad", 2, "eager") == 20.0
    text = host.describe("graph", 60.0)
    assert "one layer's four linears chained, one rank at a time" in text
    assert "chain_megatron" in text and "modelled" not in text
    assert "all ranks at once" in host.describe("eager")


def test_host_time_falls_back_figure_by_figure(tmp_path):
    """No chain: the per-layer staggered figures (replayed rows), else back to back; a chain
    with no staggered figures: its concurrent ones; Megatron's figure the other way where the
    one matching ours is not measured; bad new fields are named."""
    from megatron_overlap.simulate.calibration import CalibrationError
    from megatron_overlap.simulate.host import HostTime

    host = HostTime.load(_host_file_v2(tmp_path, chain=False, megatron=None))
    assert host.pass_us("fc1", "fprop", 8, "graph") == 30.0  # per-layer staggered
    assert host.pass_us("fc1", "fprop", 8, "eager") == 300.0  # per-layer back to back
    assert host.sources("graph")["ours"] == {2: "layer_staggered", 8: "layer_staggered"}
    assert host.megatron_pass_us("fprop", 8, "graph") is None

    host = HostTime.load(_host_file_v2(tmp_path, staggered=False, megatron=(30.0, 40.0, None, None)))
    assert host.pass_us("qkv", "fprop", 8, "graph") == pytest.approx(320 * 100 / 1000)
    assert host.sources("graph")["ours"][8] == "chain_concurrent"
    assert host.megatron_pass_us("fprop", 8, "graph") == 30.0

    host = HostTime.load(_host_file_v2(tmp_path, megatron=(None, None, 15.0, 20.0)))
    assert host.megatron_pass_us("fprop", 8, "eager") == 15.0  # the only one measured
    assert host.sources("eager")["megatron"] == {2: "chain_staggered", 8: "chain_staggered"}

    path = _host_file_v2(tmp_path)
    doc = json.loads(open(path).read())
    doc["rows"][0]["replay"]["qkv"]["fwd_staggered_us"] = -3
    bad = tmp_path / "bad_stg.json"
    bad.write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match="fwd_staggered_us"):
        HostTime.load(bad)
    doc = json.loads(open(path).read())
    doc["rows"][1]["chain_megatron"]["concurrent"]["bwd_us"] = "fast"
    bad.write_text(json.dumps(doc))
    with pytest.raises(CalibrationError, match="chain_megatron.concurrent.bwd_us"):
        HostTime.load(bad)


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_megatrons_path_pays_its_measured_host_time(tmp_path, mode):
    """With chain_megatron, the non-overlapped path costs max(GPU, Megatron's measured host
    time) per pass, in place of the modelled eager_step_us + eager_comm_us; without it, the
    modelled figure as before."""
    from megatron_overlap.simulate.host import HostTime

    spec, layout = _spec(REFERENCE["70B_tp8_fc1"], "fprop"), Layout(tp=8, mode=mode)
    plain = simulate_pass(spec, None, HW, layout, GemmModel(HW, Calibration()))
    big = 50_000.0  # above the pass's GPU time: the host decides
    for megatron, want in (((big, big, big, big), big),
                           (None, max(plain.baseline_us, HW.eager_step_us + HW.eager_comm_us)),
                           ((1.0, 1.0, 1.0, 1.0), plain.baseline_us)):
        cal = Calibration(host=HostTime.load(_host_file_v2(tmp_path, megatron=megatron)))
        r = simulate_pass(spec, None, HW, layout, GemmModel(HW, cal))
        assert r.baseline_us == pytest.approx(want) and r.overlapped_us == r.baseline_us
        over = simulate_pass(spec, _ring("fc1_fprop"), HW, layout, GemmModel(HW, cal))
        assert over.baseline_us == pytest.approx(want)
        assert over.host_us == pytest.approx(cal.host.pass_us("fc1", "fprop", 8, mode))


def test_cli_reports_which_host_figures_it_took(tmp_path, capsys):
    from megatron_overlap.cli import main

    out = tmp_path / "out.json"
    for path, ours, mcore in ((_host_file_v2(tmp_path), "chain_staggered", "chain_staggered"),
                              (_host_file(tmp_path, 500.0), "layer_b2b", None)):
        assert main(["simulate", "--shapes", "70B_tp8_qkv", "--tp", "8", "--json", str(out),
                     "--host-time", path]) == 0
        printed = capsys.readouterr().out
        meta = json.loads(out.read_text())["meta"]
        assert meta["host_time_figures"]["ours"] == {"2": ours, "8": ours}
        if mcore:
            assert meta["host_time_figures"]["megatron"] == {"2": mcore, "8": mcore}
            assert "chain_megatron" in meta["host_time"] and "chain_megatron" in printed
        else:
            want = HW.eager_step_us + HW.eager_comm_us
            assert meta["host_time_figures"]["megatron"] == {"modelled_us_per_pass": want}
            assert f"modelled {want:g} us" in meta["host_time"]


@pytest.mark.parametrize("mode", ["graph", "eager"])
def test_a_host_bound_pass_is_predicted_so_and_left_non_overlapped(tmp_path, mode):
    """Host time above the pass's GPU time: the pass is host-bound, costs its host time, and
    the tuner says "do not overlap"; a small host time changes nothing of the choice."""
    from megatron_overlap.simulate.host import HostTime
    from megatron_overlap.tune import ModelMeasure, tune

    shape, layout = REFERENCE["70B_tp8_fc1"], Layout(tp=8, mode=mode)
    spec = _spec(shape, "fprop")
    s = _ring("fc1_fprop")
    picks = {}
    for name, us in (("small", 5.0), ("large", 50_000.0)):
        cal = Calibration(host=HostTime.load(_host_file(tmp_path, us)))
        r = simulate_pass(spec, s, HW, layout, GemmModel(HW, cal))
        assert r.host_us == pytest.approx(us) and r.host_bound == (name == "large")
        assert r.overlapped_us == pytest.approx(max(us, r.overlapped_us))
        assert (r.overlapped_us > r.baseline_us) == (name == "large")
        result = tune([shape], layout, ModelMeasure(HW, layout, cal), progress=False)
        picks[name] = {row["pass"]: row for row in result.choice_rows}
        report = simulate([shape], HW, layout, cal)
        assert "measured through the public layers" in report_text(report)
    for row in picks["small"].values():
        assert row["overlap"] and not row["host_bound"]
    large = picks["large"]["fc1_fprop"]
    assert not large["overlap"] and large["host_bound"] and large["host_ms"] == pytest.approx(50.0)


def report_text(report):
    from megatron_overlap.simulate import report as rep

    return rep.console(report)


def test_cli_host_time_flag(tmp_path, capsys):
    from megatron_overlap.cli import main

    out = tmp_path / "out.json"
    argv = ["simulate", "--shapes", "70B_tp8_qkv", "--tp", "8", "--json", str(out),
            "--host-time", _host_file(tmp_path, 50_000.0)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "Host-bound" in printed and "Do not overlap" in printed and "[host-bound]" in printed
    data = json.loads(out.read_text())
    assert data["meta"]["host_time_file"].endswith("host_time.json")
    assert all(p["host_bound"] and not p["overlap_pays"] for p in data["passes"])
    yml = tmp_path / "t.yaml"
    assert main(["tune", "--model", "8b", "--tp", "2", "--measure", "model",
                 "--yaml", str(yml), "--wandb", "off", "--no-progress", "--no-cache",
                 "--host-time", _host_file(tmp_path, 50_000.0)]) == 0
    printed = capsys.readouterr().out
    assert "do not overlap" in printed and "measured through the public layers" in printed
    assert main(["simulate", "--shapes", "70B_tp8_qkv", "--tp", "8", "--host-time",
                 str(tmp_path / "missing.json")]) == 2


@pytest.mark.parametrize("aggregate", [False, True])
def test_ring_moves_deliver_each_step_s_blocks_from_peers_holding_them(aggregate):
    """What every rank sends at each transfer is what its peer receives from it there, the
    sender held it at the step before, and after it every block of the next step is in:
    the orders `ring_exchange` runs, for every rank of even worlds up to 16."""
    from megatron_overlap.overlap.ag_gemm import ring_moves

    for world in range(2, 17, 2):
        steps = [ring_steps(r, world, aggregate) for r in range(world)]
        moves = [ring_moves(r, world, aggregate) for r in range(world)]
        held = [set(steps[r][0]) for r in range(world)]
        for i in range(len(steps[0]) - 1):
            for r in range(world):
                sends, recvs = moves[r][i]
                for blocks, peer in sends:
                    assert set(blocks) <= held[r] and blocks == sorted(blocks)
                    assert (blocks, r) in moves[peer][i][1], (world, r, i)
                for blocks, peer in recvs:
                    assert (blocks, r) in moves[peer][i][0], (world, r, i)
            for r in range(world):
                held[r] |= {b for blocks, _ in moves[r][i][1] for b in blocks}
                assert set(steps[r][i + 1]) <= held[r], (world, r, i)
        assert all(h == set(range(world)) for h in held)


def test_an_aggregate_ring_is_modelled_with_the_gemms_it_runs():
    """The cost model counts an aggregate ring's GEMM calls as `ring_steps` has them (5 at
    TP=8: own, partner, three pairs), and its measured compute side, shared by rows, is
    the same total as the plain ring's for the same measurement."""
    from megatron_overlap.simulate.passes import gemm_calls

    lay = Layout(tp=8)
    assert gemm_calls(_spec(QKV8, "fprop"), _ring("qkv_fprop", aggregate=True), lay) == 5
    assert gemm_calls(_spec(QKV8, "fprop"), _ring("qkv_fprop"), lay) == 8
    assert gemm_calls(_spec(QKV8, "fprop"), _ring("qkv_fprop", aggregate=True), Layout(tp=2)) == 2
    cal = Calibration()
    m, k, n = _spec(QKV8, "fprop").gemm
    ops = _spec(QKV8, "fprop").gemm_layout
    cal.add((m, k, n, ops), 300.0, "ag_ring", 8, 400.0, 400.0, 0.0)
    hw = HW.replace(nvlink_gbs=1e5, nvlink_latency_us=0.5, sm_copy_gbs=1e4)
    gemm = GemmModel(hw, cal)
    one = simulate_pass(_spec(QKV8, "fprop"), _ring("qkv_fprop"), hw, lay, gemm)
    two = simulate_pass(_spec(QKV8, "fprop"), _ring("qkv_fprop", aggregate=True), hw, lay, gemm)
    assert one.compute_only_us == pytest.approx(400) and two.compute_only_us == pytest.approx(400)


def test_the_search_tries_each_stream_count_where_chunk_gemms_run(monkeypatch):
    """gemm_streams is searched at 0 (the process's default, 3), 1, 2, 4 and 8 for a ring
    and a pipeline of several splits, each labelled with the count it runs, and at most at
    one stream per chunk GEMM (a ring at TP=4 runs 4, an aggregate ring at TP=8 5, a
    pipeline its splits); a bulk pass and a pipeline of one split (one GEMM) are not varied
    over it."""
    monkeypatch.delenv("MEGATRON_OVERLAP_GEMM_STREAMS", raising=False)
    layout = Layout(tp=4)
    rings = [c for c in candidates("qkv_fprop", layout, 1024) if c.settings.method == "ring_exchange"
             and not c.settings.aggregate and not c.settings.wait_gemm]
    assert sorted(c.settings.gemm_streams for c in rings) == [0, 1, 2, 4]
    assert sorted(c.label() for c in rings) == ["ring 1 GEMM stream", "ring 2 GEMM streams",
                                                 "ring 3 GEMM streams (default)", "ring 4 GEMM streams"]
    pipes = candidates("proj_fprop", layout, 1024)

    def streams(splits: int) -> set[int]:
        return {c.settings.gemm_streams for c in pipes if c.settings.method == "pipeline"
                and c.settings.num_splits == splits}
    assert streams(1) == {0} and streams(4) == {0, 1, 2, 4} and streams(16) == {0, 1, 2, 4, 8}
    assert streams(2) == {0, 1}  # 2 runs what the default runs on two chunks
    assert [c.label() for c in pipes if c.settings.method == "pipeline" and c.settings.num_splits == 2
            and c.settings.gemm_streams == 0][0].startswith("pipeline x2 2 GEMM streams (default)")
    assert {c.settings.gemm_streams for c in candidates("qkv_dgrad", layout, 1024)} == {0}
    at8 = [c for c in candidates("fc1_fprop", Layout(tp=8), 1024) if not c.settings.wait_gemm]
    assert sorted(c.settings.gemm_streams for c in at8 if not c.settings.aggregate) == [0, 1, 2, 4, 8]
    assert sorted(c.settings.gemm_streams for c in at8 if c.settings.aggregate) == [0, 1, 2, 4, 5]
    agg4 = [c for c in candidates("fc1_fprop", layout, 1024)
            if c.settings.aggregate and not c.settings.wait_gemm]
    assert sorted(c.settings.gemm_streams for c in agg4) == [0, 1, 2]  # 3 GEMMs: 4 and 8 run 3
    hier = candidates("fc1_fprop", Layout(tp=8, gpus_per_node=2), 1024)
    assert sorted({c.settings.gemm_streams for c in hier
                   if c.settings.method == "ring_exchange" and c.ring_order == "hierarchical"}) \
        == [0, 1, 2, 4]  # its ring steps: twice the node's 2 ranks
    assert {c.settings.gemm_streams for c in candidates("proj_fprop", Layout(tp=1), 1024)} == {0}


@pytest.mark.parametrize("backend", ["symm", "torch_p2p"])
def test_the_search_tries_one_waiting_gemm_where_it_runs(backend):
    """wait_gemm is searched for a ring all-gather where the backend runs it (symm; not
    torch_p2p, config.effects), plain and aggregate, with no stream count (the one GEMM
    runs on the pass's stream) and labelled so; not for a reduce-scatter, nor across nodes
    (the ring's chunk GEMMs run there)."""
    rings = [c for c in candidates("qkv_fprop", Layout(tp=8, backend=backend), 1024)
             if c.settings.method == "ring_exchange"]
    waits = [c for c in rings if c.settings.wait_gemm]
    if backend == "torch_p2p":
        assert not waits
        return
    assert sorted(c.label() for c in waits) == ["ring aggregate one waiting GEMM",
                                                "ring one waiting GEMM"]
    assert {c.settings.gemm_streams for c in waits} == {0}
    assert not any(c.settings.wait_gemm for c in candidates("proj_fprop", Layout(tp=8), 1024))
    for layout in (Layout(tp=8, gpus_per_node=2), Layout(tp=1)):
        assert not any(c.settings.wait_gemm for c in candidates("fc1_fprop", layout, 1024))


def test_the_search_tries_a_waiting_gemm_only_where_its_operands_take_one():
    """trials() leaves out a waiting GEMM the layer would not run: rows per rank or N not
    in whole tiles, row-wise FP8 scales (`overlap.wait_gemm.why_not_shape`); it keeps one for
    the reference shape, in bf16 and in FP8 with per-tensor scales."""
    from megatron_overlap.simulate.numerics import Numerics

    def waiting(shape) -> set[str]:
        return {t.name for t in trials(shape, Layout(tp=8)) if t.candidate.settings.wait_gemm}
    assert waiting(QKV8) == {"qkv_fprop"}
    fp8 = dataclasses.replace(QKV8, numerics=Numerics(fp8="hybrid"))
    assert waiting(fp8) == {"qkv_fprop"}
    assert not waiting(dataclasses.replace(QKV8, numerics=Numerics(
        fp8="hybrid", scaling="rowwise", fp8_wgrad=False)))
    assert not waiting(dataclasses.replace(QKV8, m=8 * 96))  # 96 rows a rank
    assert not waiting(dataclasses.replace(QKV8, n=1000))  # N in neither 256s nor 128s


def test_a_tie_goes_to_the_least_compute_side():
    """`choose`: the fastest trial, except that among those within TIE of it the one with
    the least compute side wins (a pass its transfers bound times alike on every stream
    count); without compute sides, or beyond the tie, the fastest."""
    from megatron_overlap.simulate.space import TIE, choose

    shape = QKV8
    fprops = [t for t in trials(shape, Layout(tp=8)) if t.spec.pass_name == "fprop"][:3]
    a, b, c = fprops
    times = {a: 100.0, b: 100.0 * (1 + TIE / 2), c: 100.0 * (1 + 2 * TIE)}
    compute = {a: 90.0, b: 60.0, c: 10.0}
    assert choose(shape, times)["fprop"] is a
    assert choose(shape, times, compute)["fprop"] is b  # within the tie, less compute
    assert choose(shape, times, {a: 90.0, b: float("nan"), c: 10.0})["fprop"] is a  # unknown: last
    assert choose(shape, {**times, b: 100.0 * (1 + 2 * TIE)}, compute)["fprop"] is a
    assert choose(shape, {a: float("nan"), b: 100.0, c: 200.0}, {})["fprop"] is b  # NaN ranks last


def test_a_column_layers_backward_pairs_are_chosen_by_the_same_rule():
    """A column layer's bulk dgrad + wgrad against an rs_dgrad dgrad + its wgrad alone: by
    the pairs' fastest summed times, within TIE of each other by their summed compute sides."""
    from megatron_overlap.simulate.space import TIE, choose, trials

    tr = trials(QKV8, Layout(tp=8), rs_dgrad=True)
    bulk_d = next(t for t in tr if t.spec.pass_name == "dgrad" and t.candidate.settings.method == "bulk")
    bulk_w = next(t for t in tr if t.spec.pass_name == "wgrad" and not t.comm_moved)
    rs_d = next(t for t in tr if t.spec.pass_name == "dgrad" and t.candidate.settings.is_reduce_scatter)
    moved = next(t for t in tr if t.comm_moved)
    times = {bulk_d: 100.0, bulk_w: 50.0, rs_d: 100.0 + 150 * TIE / 2, moved: 50.0}
    assert choose(QKV8, times)["dgrad"] is bulk_d  # the faster pair
    rs_cheaper = {bulk_d: 90.0, bulk_w: 45.0, rs_d: 60.0, moved: 45.0}
    got = choose(QKV8, times, rs_cheaper)
    assert (got["dgrad"], got["wgrad"]) == (rs_d, moved)  # within the tie: less compute
    assert choose(QKV8, times, {**rs_cheaper, rs_d: 95.0})["dgrad"] is bulk_d
    slower = {**times, rs_d: 100.0 + 150 * 2 * TIE}
    assert choose(QKV8, slower, rs_cheaper)["dgrad"] is bulk_d  # beyond the tie: the fastest


def test_aggregate_auto_pairs_where_the_model_favours_the_pairs():
    """`aggregate: auto` (config.names.AGGREGATE_MIN_N) against the cost model (its H200 /
    H100 defaults, one node, symm, graphed): from AGGREGATE_MIN_N columns a rank on, a ring
    all-gather's pairs are predicted faster than its plain ring at every row count, K and
    even TP > 2 swept, in bf16 and in FP8 (the same balance: twice the FLOP/s, half the
    bytes); and at the 70B and 8B presets' ring all-gathers auto is predicted no slower than
    TE's plain ring at any pass, and faster over the four."""
    from megatron_overlap.config.names import AGGREGATE_MIN_N
    from megatron_overlap.simulate.numerics import Numerics

    gemm = GemmModel(HW)

    def fprop(shape, **kw):
        return simulate_pass(_spec(shape, "fprop"), _ring("qkv_fprop", **kw), HW,
                             Layout(tp=shape.tp), gemm).overlapped_us
    for numerics in (Numerics(), Numerics(fp8="hybrid")):
        for tp in (4, 8):
            for m in (4096, 8192, 16384):
                for k in (4096, 8192):
                    for n in (AGGREGATE_MIN_N, 4096, 7168, 14336):
                        shape = Shape("S", "qkv", m, k, n, tp, numerics=numerics)
                        assert fprop(shape, aggregate=True) < fprop(shape, aggregate=False), (
                            numerics.fp8, tp, m, k, n)
    for model, tp in (("70b", 8), ("8b", 4), ("70b", 4)):
        auto = plain = 0.0
        for shape in parse_shapes(model, tp):
            for spec in layer_passes(shape):
                if spec.name not in ("qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad"):
                    continue
                s = LayerSettings.default(spec.name)
                a = simulate_pass(spec, s, HW, Layout(tp=tp), gemm).overlapped_us
                p = simulate_pass(spec, dataclasses.replace(s, aggregate=False), HW,
                                  Layout(tp=tp), gemm).overlapped_us
                assert a <= p, (model, tp, spec.name)
                auto, plain = auto + a, plain + p
        assert auto < plain, (model, tp)
