"""The operand layout of each pass's GEMM (fprop NT, dgrad NN, wgrad TN: `PassSpec.gemm_layout`):
what the layer's passes really multiply, how the one-GPU timers build it, and that the tuner's
compute-side measurement and the calibration keep one timing per (m, k, n, layout)."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from megatron_overlap.comm import NullTransport
from megatron_overlap.simulate import Calibration, GemmModel, Hardware, Layout, Shape, trials
from megatron_overlap.simulate.calibration import CalibrationError
from megatron_overlap.simulate.passes import layer_passes
from megatron_overlap.simulate.shapes import GEMM_LAYOUTS
from megatron_overlap.tune.measure import gemm_operands

BUFFERS = ("qkv", "proj", "fc1", "fc2")


def _layout_of(a: torch.Tensor, b: torch.Tensor) -> str:
    """The operand layout of a @ b (2-D, or batched: each matrix's) from the operands' strides:
    N where an operand's rows are contiguous, T where it is a transposed view (its columns
    contiguous)."""
    def letter(t: torch.Tensor) -> str:
        assert t.dim() in (2, 3) and min(t.shape[-2:]) > 1, t.shape  # strides unambiguous
        if t.stride(-1) == 1:
            return "N"
        assert t.stride(-2) == 1, t.stride()
        return "T"
    return letter(a) + letter(b)


def test_every_pass_has_one_layout_by_kind():
    shape = Shape("S", "qkv", 64, 32, 16, 4)
    got = {p.pass_name: p.gemm_layout for p in layer_passes(shape)}
    assert got == {"fprop": "NT", "dgrad": "NN", "wgrad": "TN"} == GEMM_LAYOUTS


@pytest.mark.parametrize("layout", ["NT", "NN", "TN", "TT"])
def test_gemm_operands_build_the_layout(layout):
    a, b = gemm_operands(24, 40, 56, layout, device="cpu", dtype=torch.float32)
    assert a.shape == (24, 40) and b.shape == (40, 56)
    assert _layout_of(a, b) == layout
    # T: a view of a contiguous tensor (as the layer's weight.t() and g.t() are)
    assert a.t().is_contiguous() == (layout[0] == "T") and a.is_contiguous() == (layout[0] == "N")
    assert b.t().is_contiguous() == (layout[1] == "T") and b.is_contiguous() == (layout[1] == "N")
    assert torch.allclose(torch.matmul(a, b), a.contiguous() @ b.contiguous())


@pytest.mark.parametrize("bad", ["nt", "N", "NTN", "XY", None])
def test_gemm_operands_refuse_an_unknown_layout(bad):
    with pytest.raises(ValueError, match="operand layout"):
        gemm_operands(8, 8, 8, bad, device="cpu")


def _recorded_mms(monkeypatch) -> list:
    """Every torch.mm / torch.bmm (the pipeline's batched chunks) the code under test runs:
    (a's matrix shape, b's matrix shape, layout)."""
    calls: list = []

    def recording(real):
        def mm(a, b, *args, **kw):
            calls.append((tuple(a.shape[-2:]), tuple(b.shape[-2:]), _layout_of(a, b)))
            return real(a, b, *args, **kw)
        return mm

    monkeypatch.setattr(torch, "mm", recording(torch.mm))
    monkeypatch.setattr(torch, "bmm", recording(torch.bmm))
    return calls


@pytest.mark.parametrize("buffer", BUFFERS)
def test_the_layers_passes_multiply_in_their_passes_layout(buffer, monkeypatch):
    """Each of the 12 passes, run by the layer's own pass functions (`tune.passes.trial_pass`,
    on CPU and the null transport), with one candidate of every method (ring, pipeline,
    bulk, external, rs_dgrad, a moved reduce-scatter) and as the plain non-overlapped path:
    every GEMM it runs has the operand layout `PassSpec.gemm_layout` states, the pass's
    (k, n), and rows that cut its m; `gemm_operands` builds that same layout at full size."""
    from megatron_overlap.tune.passes import trial_pass

    layout = Layout(tp=4)
    shape = Shape("S", buffer, 64, 32, 48, 4)
    picked = {}
    for rs_dgrad in (False, True):
        for t in trials(shape, layout, rs_dgrad=rs_dgrad):
            picked.setdefault((t.name, t.candidate.settings.method, t.comm_moved), t)
    assert {name for name, _, _ in picked} == {f"{buffer}_{p}" for p in GEMM_LAYOUTS}
    calls = _recorded_mms(monkeypatch)
    seen = Counter()
    for (name, method, moved), t in picked.items():
        m, k, n = t.spec.gemm
        want = t.spec.gemm_layout
        for overlap in (True, False):
            calls.clear()
            trial_pass(t, NullTransport(4), "cpu", torch.float32, overlap=overlap).run()
            assert calls, (name, method, overlap)
            for a_shape, b_shape, got in calls:
                assert got == want, (name, method, moved, overlap, a_shape, b_shape)
                assert b_shape == (k, n) and a_shape[1] == k and m % a_shape[0] == 0, \
                    (name, a_shape, b_shape, t.spec.gemm)
            seen[t.spec.pass_name] += 1
        a, b = gemm_operands(m, k, n, want, device="cpu", dtype=torch.float32)
        assert (tuple(a.shape), tuple(b.shape), _layout_of(a, b)) == ((m, k), (k, n), want)
    assert set(seen) == set(GEMM_LAYOUTS)


# -- the one-GPU tuner: one monolithic timing per (m, k, n, layout) -----------------------------

def _fake_measure(times: dict[str, float]):
    """ComputeSideMeasure on CPU whose fake timers return `times[layout]` ms for the monolithic
    GEMM (and a chunked pass 1.1x that), recording what they were asked for."""
    from megatron_overlap.tune import ComputeSideMeasure

    asked: dict[str, list] = {"gemm": [], "pass": []}

    def time_gemm(m, k, n, layout, dtype, fast_accum=False):
        asked["gemm"].append((m, k, n, layout))
        return {"mono_graph_ms": times[layout], "mono_ms": times[layout]}

    def time_pass(fn, m, k, n, layout, dtype, fast_accum=False):
        asked["pass"].append((m, k, n, layout))
        t = times[layout]
        return {"mono_graph_ms": t, "mono_ms": t, "sched_graph_ms": 1.1 * t,
                "sched_ms": 1.2 * t, "host_us_sched": 10.0}

    measure = ComputeSideMeasure(Hardware(), Layout(tp=4), reps=1, device="cpu",
                                 dtype=torch.float32, time_gemm=time_gemm, time_pass=time_pass)
    return measure, asked


def _some_trials(shape, layout):
    """One trial per (pass, method, moved): every kind of compute side the model has."""
    picked = {}
    for rs_dgrad in (False, True):
        for t in trials(shape, layout, rs_dgrad=rs_dgrad):
            picked.setdefault((t.name, t.candidate.settings.method, t.comm_moved), t)
    return list(picked.values())


@pytest.mark.parametrize("buffer", ["qkv", "proj"])
def test_compute_side_times_each_layout_apart_and_uses_the_passs_own(buffer):
    """fprop [64,32]x[32,32] and dgrad [64,32]x[32,32] share (m, k, n) but not the layout:
    each is timed once in its own layout (the wgrad in TN), and every pass's monolithic GEMM
    (baseline, bulk / external compute side) follows its own layout's time: raising the NN
    time moves the dgrad's figures by exactly that and no other pass's."""
    layout = Layout(tp=4)
    shape = Shape("S", buffer, 64, 32, 32, 4)
    a_times = {"NT": 1.0, "NN": 0.6, "TN": 0.8}
    b_times = {**a_times, "NN": 0.9}
    (ma, asked), (mb, _) = _fake_measure(a_times), _fake_measure(b_times)
    todo = _some_trials(shape, layout)
    ra = {(t.name, t.candidate.settings.method, t.comm_moved): ma(t) for t in todo}
    rb = {(t.name, t.candidate.settings.method, t.comm_moved): mb(t) for t in todo}
    assert sorted(asked["gemm"]) == sorted([(64, 32, 32, "NT"), (64, 32, 32, "NN"),
                                            (32, 64, 32, "TN")])  # once each
    assert asked["pass"]  # the chunked passes: each against its own layout's GEMM
    chunked = {(t.spec.gemm, t.spec.gemm_layout) for t in todo
               if t.candidate.settings.method in ("ring_exchange", "pipeline")}
    assert {((m, k, n), lay) for m, k, n, lay in asked["pass"]} == chunked
    assert ma.calibration.mono == {(64, 32, 32, "NT"): 1000.0, (64, 32, 32, "NN"): 600.0,
                                   (32, 64, 32, "TN"): 800.0}
    for t in todo:
        key = (t.name, t.candidate.settings.method, t.comm_moved)
        shift = (b_times[t.spec.gemm_layout] - a_times[t.spec.gemm_layout])
        assert rb[key]["baseline_ms"] - ra[key]["baseline_ms"] == pytest.approx(shift), key
        if t.spec.pass_name != "dgrad":
            assert rb[key] == ra[key], key
    for t in todo:  # the GEMM alone: exactly its layout's time
        key = (t.name, t.candidate.settings.method, t.comm_moved)
        if t.candidate.settings.method == "external" or t.comm_moved:
            assert ra[key]["compute_only_ms"] == pytest.approx(a_times[t.spec.gemm_layout]), key
    dgrad_bulk = [(t.name, "bulk", False) for t in todo
                  if t.spec.pass_name == "dgrad" and t.candidate.settings.method == "bulk"]
    assert bool(dgrad_bulk) == (buffer == "qkv")  # a column dgrad may run bulk
    for key in dgrad_bulk:  # held num_sm SMs short: the NN time, scaled
        assert rb[key]["compute_only_ms"] / ra[key]["compute_only_ms"] == \
            pytest.approx(0.9 / 0.6, rel=0.05), key


def test_compute_side_dgrad_follows_nn_whatever_was_measured_first():
    """The bug: the first (m, k, n) timed served every pass of that size. Now a dgrad timed
    after an fprop of the same (m, k, n) gets its own NN time."""
    layout = Layout(tp=4)
    shape = Shape("S", "proj", 64, 32, 32, 4)
    times = {"NT": 1.0, "NN": 0.5, "TN": 0.8}
    fprop, dgrad = (next(t for t in trials(shape, layout) if t.name == f"proj_{p}")
                    for p in ("fprop", "dgrad"))
    measure, _ = _fake_measure(times)
    measure(fprop)
    after = measure(dgrad)
    alone, _ = _fake_measure(times)
    assert after == alone(dgrad)
    nn_only, _ = _fake_measure({**times, "NT": 5.0})
    assert nn_only(dgrad)["baseline_ms"] == pytest.approx(after["baseline_ms"])


# -- the calibration: keyed by layout, old files read as NT ------------------------------------

def _row(**kw):
    row = {"shape": "70B_tp8_qkv", "m": 8192, "k": 8192, "n": 1280, "op": "ag", "tp": 8,
           "schedule": "ring", "chunks": 8, "gemm_streams": 1, "mono_ms": 0.31, "sched_ms": 0.6,
           "mono_graph_ms": 0.3, "sched_graph_ms": 0.4, "host_us_sched": 800.0}
    return {**row, **kw}


def test_calibration_rows_without_a_layout_are_nt_and_lookups_keep_layouts_apart(tmp_path):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"rows": [_row(), _row(layout="NN", mono_graph_ms=0.2,
                                                      sched_graph_ms=0.3)]}))
    cal = Calibration.load(path)
    assert cal.mono == {(8192, 8192, 1280, "NT"): pytest.approx(300),
                        (8192, 8192, 1280, "NN"): pytest.approx(200)}
    hw = Hardware()
    gemm = GemmModel(hw, cal)
    assert gemm.mono_us(8192, 8192, 1280, "NT") == pytest.approx(300)
    assert gemm.mono_us(8192, 8192, 1280, "NN") == pytest.approx(200)
    assert gemm.chunk_us(8192, 8192, 1280, "NN", 8, "ag_ring") == pytest.approx(300 / 8)
    # never another layout's timing: TN here is the (fitted) roofline
    assert gemm.source(8192, 8192, 1280, "TN") == "roofline"
    assert gemm.source(8192, 8192, 1280, "NN") == "measured"
    one = Calibration.load(_write(tmp_path / "nt.json", [_row()]))
    assert GemmModel(hw, one).source(8192, 8192, 1280, "NN") == "roofline"


def _write(path, rows):
    path.write_text(json.dumps({"rows": rows}))
    return path


def test_calibration_refuses_a_bad_layout(tmp_path):
    path = _write(tmp_path / "bad.json", [_row(), _row(layout="XN")])
    with pytest.raises(CalibrationError, match=r"row 1, field 'layout': expected an operand "
                                               r"layout .* got 'XN'"):
        Calibration.load(path)


def test_calibration_add_needs_the_layout():
    cal = Calibration()
    with pytest.raises(ValueError, match="operand layout"):
        cal.add((64, 32, 32), 100.0)  # type: ignore[arg-type]


def test_model_only_mode_ignores_the_layout():
    """No calibration: the roofline, the same for every layout."""
    gemm = GemmModel(Hardware())
    assert len({gemm.mono_us(8192, 8192, 1280, lay) for lay in ("NT", "NN", "TN")}) == 1
