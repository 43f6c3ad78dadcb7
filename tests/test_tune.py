"""The tuner on CPU: the cost-model-only mode writes a YAML that install() takes and
the layers then run; the cache resumes an interrupted search; only valid settings
are ever tried; the search and the choice land in an offline wandb run; the
several-GPU measurement hook runs on gloo ranks."""

import dataclasses
import json
import math
import os

import pytest
import torch

from helpers import dist
from megatron_overlap.config import LayerSettings, OverlapConfig
from megatron_overlap.config.names import EXTERNAL_PAIRS, RS_DGRAD_LAYERS
from megatron_overlap.config.settings import allowed_methods
from megatron_overlap.simulate import PRESETS, Hardware, Layout, Shape, trials
from megatron_overlap.tune import Cache, ModelMeasure, tune

SHAPES = PRESETS["70b"].shapes("70B", 8)


def _fake(counter: list, fail_after: int | None = None):
    """A measurement callable: deterministic times from the settings, counted."""
    def measure(trial):
        if fail_after is not None and len(counter) >= fail_after:
            raise KeyboardInterrupt("interrupted")
        counter.append(trial)
        s = trial.candidate.settings
        return {"time_ms": 1.0 + s.num_sm / 100 + (s.num_splits or 0) / 1000 + (s.aggregate is True) * 0.01
                + (0.5 if trial.candidate.ring_order == "flat" else 0)}
    measure.hardware = {"kind": "fake"}
    return measure


def test_cpu_mode_writes_a_yaml_that_layers_use(tmp_path, capsys):
    """`megatron-overlap tune` on CPU: says it is the cost model only, and its YAML is what
    install() reads and our layers then run (and they still match Megatron's)."""
    from megatron_overlap.cli import main

    yml = tmp_path / "tuned.yaml"
    # slow links make the model prefer other settings than TE's defaults
    argv = ["tune", "--model", "8b", "--tp", "2", "--measure", "auto", "--yaml", str(yml),
            "--wandb", "off", "--no-progress", "--hw", "nvlink_gbs=40", "--hw", "sm_copy_gbs=20"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "cost model's prediction" in out and "not a measurement" in out
    cfg = OverlapConfig.load(str(yml))
    assert cfg != OverlapConfig.load(None)  # the search changed something
    search = json.loads((tmp_path / "tuned.yaml.json").read_text())
    assert search["mode"] == "model" and "not a measurement" in search["note"]
    assert search["ub_cfgs"]["8B"] == cfg.to_dict()
    assert len(search["chosen"]) == 12 and len(search["trials"]) > 12
    for row in search["chosen"]:
        assert row["time_ms"] == min(t["time_ms"] for t in search["trials"]
                                     if t["pass"] == row["pass"] and not t["comm_moved"])
        assert row["time_ms"] <= row["te_default_ms"]  # TE's defaults are among the candidates
    assert any(r["time_ms"] < r["te_default_ms"] for r in search["chosen"])
    assert "dflt ms" in out and "all passes" in out

    got = dist.run(_layers_rank, 2, str(yml))
    for rank in got:
        for buffer, passes in (("qkv", ("fprop", "dgrad", "wgrad")), ("proj", ("fprop", "dgrad"))):
            for p in passes:
                assert rank[buffer][p] == cfg[f"{buffer}_{p}"], (buffer, p)
            assert max(rank[buffer]["errors"].values()) < 1e-5, rank[buffer]["errors"]
            rows = {r["pass"]: r for r in rank[buffer]["rows"]}
            assert rows["fprop"]["method"] == cfg[f"{buffer}_fprop"].method
            assert rows["fprop"]["num_splits"] == cfg[f"{buffer}_fprop"].splits(2)


def _layers_rank(rank, world, yaml_path):
    from helpers.tune_ranks import layers_with_tuned_yaml

    return layers_with_tuned_yaml(rank, world, yaml_path)


def test_cache_resumes_an_interrupted_search(tmp_path):
    layout = Layout(tp=8)
    total = len([t for s in SHAPES for t in trials(s, layout)])
    path = tmp_path / "cache.jsonl"
    first: list = []
    with pytest.raises(KeyboardInterrupt):
        tune(SHAPES, layout, _fake(first, fail_after=10), cache=Cache(path), progress=False)
    assert len(first) == 10
    with open(path, "a") as f:
        f.write('{"key": "torn')  # killed mid-write
    second: list = []
    resumed = tune(SHAPES, layout, _fake(second), cache=Cache(path), progress=False)
    assert len(second) == total - 10
    assert (resumed.measured, resumed.cached) == (total - 10, 10)
    assert not set(map(id, first)) & set(map(id, second))
    third: list = []
    again = tune(SHAPES, layout, _fake(third), cache=Cache(path), progress=False)
    assert third == [] and again.cached == total
    fresh = tune(SHAPES, layout, _fake([]), progress=False)  # no cache at all
    for model in fresh.configs:
        assert again.configs[model] == resumed.configs[model] == fresh.configs[model]
    # another machine: nothing is reused
    fourth: list = []
    other = _fake(fourth)
    other.hardware = {"kind": "fake", "gpu": "other"}
    tune(SHAPES, layout, other, cache=Cache(path), progress=False)
    assert len(fourth) == total


@pytest.mark.parametrize("layout,rs_dgrad", [
    (Layout(tp=8), False), (Layout(tp=8, backend="torch_p2p"), True),
    (Layout(tp=16, gpus_per_node=8, backend="nvshmem"), True)])
def test_invalid_combinations_are_never_tried(layout, rs_dgrad):
    tried: list = []
    shapes = PRESETS["70b"].shapes("70B", layout.tp)
    result = tune(shapes, layout, _fake(tried), rs_dgrad=rs_dgrad, progress=False)
    assert tried and len({(t.spec, t.candidate, t.comm_moved) for t in tried}) == len(tried)
    for t in tried:
        s, name = t.candidate.settings, t.name
        assert LayerSettings(**dataclasses.asdict(s)) == s  # TE's rules, checked again
        assert s.method in allowed_methods(name)
        if name in RS_DGRAD_LAYERS and not rs_dgrad:
            assert s.method == "bulk"
        if name in EXTERNAL_PAIRS:
            assert s.method == "external"
        if s.method == "pipeline":
            assert (t.spec.shape.m // layout.tp) % s.num_splits == 0
        effects = s.effects(layout.backend)
        default = LayerSettings.te_default(name, s.method)
        assert s.aggregate in (False, True), (name, s.aggregate)  # never "auto": resolved
        for key in ("use_ce", "num_sm", "aggregate", "ring_order"):
            if effects[key] != "active":
                assert getattr(s, key) == getattr(default, key), (name, key)
        if layout.nodes == 1:
            assert s.ring_order == "auto"
    for model, cfg in result.configs.items():  # the choice is a valid config as a whole
        assert OverlapConfig.load(cfg.to_dict()) == cfg
        assert OverlapConfig.load(cfg.to_yaml()) == cfg


def test_search_and_choice_logged_to_offline_wandb(tmp_path, monkeypatch):
    import wandb

    from megatron_overlap.telemetry import read_offline_run, wait_for_exit

    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    layout = Layout(tp=8)
    shapes = SHAPES[:2]
    run = wandb.init(mode="offline", dir=tmp_path, project="tune-test",
                     settings=wandb.Settings(console="off", x_disable_stats=True, disable_git=True,
                                             save_code=False))
    try:
        result = tune(shapes, layout, ModelMeasure(Hardware(), layout), run=run, progress=False)
    finally:
        run.finish()
    wait_for_exit(run.dir)
    got = read_offline_run(run.dir)
    history = got["history"]
    assert [h["_step"] for h in history] == list(range(len(result.rows)))
    for h, row in zip(history, result.rows):
        assert h["tune/time_ms"] == pytest.approx(row["time_ms"])
        assert h["tune/cached"] == 0
    search = got["tables"]["tune/search"]
    assert len(search) == len(result.rows)
    assert [(r["pass"], r["method"], r["time_ms"]) for r in search] == \
        [(r["pass"], r["settings"]["method"], pytest.approx(r["time_ms"])) for r in result.rows]
    choice = got["tables"]["tune/choice"]
    assert [(c["shape"], c["pass"]) for c in choice] == \
        [(s.name, f"{s.buffer}_{p}") for s in shapes for p in ("fprop", "dgrad", "wgrad")]
    cfg = got["config"]["megatron_overlap_tune"]
    assert cfg["mode"] == "model" and "not a measurement" in cfg["note"]
    assert cfg["ub_cfgs"]["70B"] == result.configs["70B"].to_dict()
    assert cfg["measured"] == len(result.rows)


@pytest.mark.parametrize("local", [2, 1])
def test_distributed_hook_runs_every_trial_on_gloo_ranks(local):
    """The several-GPU measurement, run for real on two CPU ranks (local=1: two emulated
    nodes, so hierarchical and flat ring orders both run)."""
    per_rank = dist.run(_hook_rank, 2, local, env={"LOCAL_WORLD_SIZE": str(local)})
    assert len(per_rank[0]) == len(per_rank[1]) > 0
    for a, b in zip(*per_rank):
        assert (a["pass"], a["label"]) == (b["pass"], b["label"])
        assert a["time_ms"] == b["time_ms"]  # the slowest rank's, on both
        for k in ("time_ms", "baseline_ms", "compute_only_ms"):
            assert math.isfinite(a[k]) and a[k] > 0, a
    runs = {r["runs"] for r in per_rank[0]}
    assert runs == ({"flat", "hierarchical", "-"} if local == 1 else {"flat", "-"})
    if local == 1:
        hier = [r for r in per_rank[0] if r["runs"] == "hierarchical"]
        assert all(r["ring_order"].startswith("hierarchical") for r in hier)
    kinds = {r["pass"] for r in per_rank[0]}
    assert kinds == {"qkv_fprop", "qkv_dgrad", "qkv_wgrad", "proj_fprop", "proj_dgrad",
                     "proj_wgrad"}


def _hook_rank(rank, world, local):
    from helpers.tune_ranks import distributed_measure

    return distributed_measure(rank, world, local)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: times cuBLAS GEMMs")
def test_compute_side_measure_on_one_gpu():
    from megatron_overlap.tune import ComputeSideMeasure

    layout = Layout(tp=8)
    measure = ComputeSideMeasure(Hardware(), layout, reps=3)
    shape = Shape("S", "qkv", 2048, 1024, 512, 8)
    got = [measure(t) for t in trials(shape, layout)[:3]]
    assert all(r["time_ms"] > 0 and "measured" in r["source"] for r in got)
    assert (2048, 1024, 512, "NT") in measure.calibration.mono_samples


def test_the_tuner_times_the_layers_own_passes():
    """Each trial's timed pass (four gloo ranks: at two, an aggregate ring is the plain
    one), fed what our layer with the same settings saw, gives that layer's outputs and makes exactly its transfers, waits and GEMM
    chunks in its order: the tuner runs the layer's passes, not a copy of them."""
    per_rank = dist.run(_same_as_layer_rank, 4)
    for rows in per_rank:
        assert {r["pass"] for r in rows} == {"qkv_fprop", "qkv_dgrad", "qkv_wgrad",
                                             "proj_fprop", "proj_dgrad", "proj_wgrad"}
        for r in rows:
            assert r["same_trace"] and r["events"] > 0, r
            assert r["errors"] and max(r["errors"].values()) <= 1e-5, r
        # the communicating passes did communicate (a trace of GEMMs alone proves less)
        talking = {r["pass"] for r in rows if r["transfers"] > 0}
        assert talking == {"qkv_fprop", "qkv_dgrad", "qkv_wgrad", "proj_fprop", "proj_dgrad"}
        assert any(r["moved"] and r["transfers"] == 0 for r in rows)


def _same_as_layer_rank(rank, world):
    from helpers.tune_ranks import tuner_pass_matches_layer

    return tuner_pass_matches_layer(rank, world)


def _cpu_compute_side(layout, monkeypatch):
    """The one-GPU measurement on CPU: its timers injected (each runs the timed pass once and
    makes up times), every timed pass's settings as the layer's functions received them
    recorded: the streams `pass_streams` resolved and the `aggregate` the ring was asked for."""
    from megatron_overlap.layers import functions as F
    from megatron_overlap.tune import ComputeSideMeasure

    ran: list = []
    real_streams, real_ag = F.pass_streams, F.all_gather_matmul

    timing: list = []  # the timed pass's record while one runs

    def pass_streams(tp, s):
        out = real_streams(tp, s)
        if timing:
            timing[0].update(gemm_streams=out[1].n, settings=s)
        return out

    def all_gather_matmul(*args, aggregate=False, **kw):
        if timing:
            timing[0]["aggregate"] = aggregate
        return real_ag(*args, aggregate=aggregate, **kw)

    monkeypatch.setattr(F, "pass_streams", pass_streams)
    monkeypatch.setattr(F, "all_gather_matmul", all_gather_matmul)

    def time_pass(fn, m, k, n, layout, dtype, fast_accum=False):
        ran.append({})
        timing.append(ran[-1])
        try:
            fn()  # the pass as the tuner would time it
        finally:
            timing.clear()
        s = ran[-1]["settings"]
        ms = 1.0 - 0.1 * (ran[-1]["gemm_streams"] > 1) - 0.05 * ran[-1].get("aggregate", False)
        return {"mono_graph_ms": 0.5, "sched_graph_ms": ms + s.splits(4) / 1000, "sched_ms": ms,
                "host_us_sched": 10.0, "mono_ms": 0.5}

    measure = ComputeSideMeasure(Hardware(), layout, reps=1, device="cpu", dtype=torch.float32,
                                 time_gemm=lambda m, k, n, layout, dtype, fast_accum=False: {
                                     "mono_graph_ms": 0.5, "mono_ms": 0.5},
                                 time_pass=time_pass)
    return measure, ran


def _variant(trials_, name, **settings):
    """The one trial of pass `name` whose settings differ from the default only in
    `settings` (the default's `aggregate: auto` as the pass runs it: `as_run`)."""
    from megatron_overlap.config import LayerSettings
    from megatron_overlap.simulate.passes import as_run

    found = [t for t in trials_ if t.name == name and not t.comm_moved
             and t.candidate.settings == dataclasses.replace(
                 as_run(t.spec, LayerSettings.default(name), t.candidate.layout), **settings)]
    assert len(found) == 1, (name, settings, len(found))
    return found[0]


@pytest.mark.parametrize("key,value", [("aggregate", True), ("gemm_streams", 1)])
def test_compute_side_times_every_candidate_with_its_own_settings(tmp_path, monkeypatch, key,
                                                                  value):
    """One GPU (on CPU, timers injected): two candidates differing only in aggregate, or only in
    gemm_streams, are timed apart, each pass run with its own setting (gemm_streams 0: the
    default's 3 streams), the model fed each one's own timing; and their cache keys differ
    (the on-disk cache too, versioned)."""
    from megatron_overlap.tune import cache_key, job_of
    from megatron_overlap.tune.cache import KEY_VERSION
    from megatron_overlap.tune.passes import timed_key
    from megatron_overlap.comm import NullTransport
    from megatron_overlap.config.names import DEFAULT_GEMM_STREAMS

    monkeypatch.delenv("MEGATRON_OVERLAP_GEMM_STREAMS", raising=False)
    layout = Layout(tp=4)
    measure, ran = _cpu_compute_side(layout, monkeypatch)
    shape = Shape("S", "qkv", 64, 32, 16, 4)  # qkv_fprop: a ring all-gather
    all_trials = trials(shape, layout)
    plain = _variant(all_trials, "qkv_fprop")
    other = _variant(all_trials, "qkv_fprop", **{key: value})
    assert timed_key(plain, NullTransport(4)) != timed_key(other, NullTransport(4))
    a, b = measure(plain), measure(other)
    assert len(ran) == 2  # timed apart, not one timing for both
    assert ran[0]["gemm_streams"] == DEFAULT_GEMM_STREAMS == 3 and ran[0]["aggregate"] is False
    if key == "aggregate":
        assert ran[1]["aggregate"] is True and ran[1]["gemm_streams"] == 3
        assert b["compute_only_ms"] < a["compute_only_ms"]  # each predicted from its own timing
    else:
        assert ran[1]["gemm_streams"] == 1 and ran[1]["aggregate"] is False
        assert b["compute_only_ms"] > a["compute_only_ms"]  # (the timer favours more streams)
    assert ran[1]["settings"] == dataclasses.replace(ran[0]["settings"], **{key: value})
    assert measure(plain) == {k: v for k, v in a.items() if not k.startswith("measured")}
    assert len(ran) == 2  # timed once each: the second call reuses the in-memory timing
    hw = measure.hardware
    assert cache_key(job_of(plain), hw) != cache_key(job_of(other), hw)
    # the on-disk cache: entries of another key version are never served
    path = tmp_path / "cache.jsonl"
    cache = Cache(path)
    cache.put(cache_key(job_of(other), hw), job_of(other), hw, b)
    with open(path, "a") as f:  # an entry of the old format (no version) for `plain`
        f.write(json.dumps({"key": cache_key(job_of(plain), hw), "job": job_of(plain),
                            "hardware": hw, "result": a}) + "\n")
    again = Cache(path)
    assert cache_key(job_of(other), hw) in again and cache_key(job_of(plain), hw) not in again
    assert json.loads(path.read_text().splitlines()[0])["version"] == KEY_VERSION


def test_compute_side_shares_timings_only_where_the_pass_runs_the_same(monkeypatch):
    """num_sm holds nothing back on the null transport (the model applies the margin), so
    candidates differing only there share one timing; a whole search times each distinct
    (aggregate, gemm_streams, num_splits, wait_gemm) pass once (a waiting GEMM only where
    the rows per rank are whole tiles), and a hierarchical ring (two nodes) runs with its
    nodes."""
    layout = Layout(tp=4)
    measure, ran = _cpu_compute_side(layout, monkeypatch)
    shape = Shape("S", "proj", 64, 32, 16, 4)  # proj_fprop: pipeline x num_sm; dgrad: ring
    result = tune([shape], layout, measure, progress=False)
    distinct = {(r["pass"], r["settings"].get("aggregate"), r["settings"].get("gemm_streams", 0),
                 r["settings"]["method"], r["settings"].get("num_splits"),
                 r["settings"].get("wait_gemm", False))
                for r in result.rows if r["pass"] != "proj_wgrad"}
    sms = {r["settings"]["num_sm"] for r in result.rows if r["pass"] == "proj_fprop"}
    assert len(sms) > 1 and len(ran) == len(distinct) == len(measure.timed)
    assert not any(d[-1] for d in distinct)  # 16 rows a rank: no waiting GEMM to try
    # whole tiles (128 rows a rank): the dgrad's ring with one waiting GEMM, timed as such
    tiles = Shape("T", "proj", 4 * 128, 256, 256, 4)
    waiting = [t for t in trials(tiles, layout) if t.candidate.settings.wait_gemm]
    assert {t.name for t in waiting} == {"proj_dgrad"}
    before = len(measure.timed)
    assert math.isfinite(measure(waiting[0])["time_ms"]) and len(measure.timed) == before + 1
    assert ran[-1]["settings"].wait_gemm
    # two nodes of two: the hierarchical order runs on the null transport too
    layout = Layout(tp=4, gpus_per_node=2)
    measure, ran = _cpu_compute_side(layout, monkeypatch)
    hier = [t for t in trials(shape, layout) if t.candidate.ring_order == "hierarchical"]
    assert hier and all(math.isfinite(measure(t)["time_ms"]) for t in hier)


def test_the_tuner_takes_the_least_compute_side_within_the_tie(tmp_path):
    """`tune` hands each trial's measured `compute_only_ms` to `choose`: of two stream
    counts whose times differ by less than the tie, the one with the less compute side is
    picked (and written to the YAML); beyond the tie, the faster. A measure without compute
    sides picks the fastest."""
    from megatron_overlap.simulate.space import TIE

    qkv = [s for s in SHAPES if s.buffer == "qkv"]
    layout = Layout(tp=8)

    def measure_with(gap: float):
        def measure(trial):
            s = trial.candidate.settings
            ring = s.method == "ring_exchange" and not s.aggregate
            fast = ring and s.gemm_streams == 1  # the fastest time, the most compute
            cheap = ring and s.gemm_streams == 8  # a time `gap` above, the least compute
            time = 1.0 if fast else 1.0 + gap if cheap else 2.0
            return {"time_ms": time, "compute_only_ms": 0.9 if fast else 0.5 if cheap else 1.5}
        measure.hardware = {"kind": "fake", "gap": gap}
        return measure

    def qkv_fprop_streams(result) -> int:
        return result.configs["70B"]["qkv_fprop"].gemm_streams

    assert qkv_fprop_streams(tune(qkv, layout, measure_with(TIE / 2), progress=False)) == 8
    assert qkv_fprop_streams(tune(qkv, layout, measure_with(2 * TIE), progress=False)) == 1
    plain = measure_with(TIE / 2)
    no_compute = lambda t: {"time_ms": plain(t)["time_ms"]}  # noqa: E731
    no_compute.hardware = {"kind": "fake"}
    assert qkv_fprop_streams(tune(qkv, layout, no_compute, progress=False)) == 1


def test_the_defaults_are_timed_at_every_pass():
    """The candidate that runs the defaults (TE's, `aggregate: auto` resolved per pass as
    the layer resolves it) is among every pass's trials at TP 2, 4 and 8, so every chosen
    row says what the defaults took."""
    for tp in (2, 4, 8):
        result = tune(PRESETS["70b"].shapes("70B", tp), Layout(tp=tp), _fake([]), progress=False)
        rows = result.choice_rows
        assert len(rows) == 12, tp
        assert all(r.get("te_default_ms") is not None for r in rows), (
            tp, [r["pass"] for r in rows if r.get("te_default_ms") is None])
