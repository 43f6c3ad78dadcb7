"""The benchmark suite runs end to end on CPU (2 gloo ranks, tiny shapes) and
writes what docs/results.md is built from: JSON of the expected structure, with
every output check / loss parity passed, and a PNG. Timings are never asserted."""

import json
import os
import subprocess
import sys
from collections import Counter

import pytest

from megatron_overlap.ab.launch import Layout
from megatron_overlap.ab.layer_arms import Method, parse_methods
from megatron_overlap.ab.shapes import BY_NAME, parse, scaled
from megatron_overlap.ab.timing import balanced_orders, hidden_fraction, rotated, serial_order, summary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(script: str, *args: str, out) -> dict:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--device", "cpu",
                           "--out", str(out), "--tag", "test", *args],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "FUNCTIONAL ONLY" in proc.stdout  # CPU numbers say what they are
    stem = out / script.replace(".py", "_test")
    assert stem.with_suffix(".png").stat().st_size > 10_000
    return json.loads(stem.with_suffix(".json").read_text())


def test_layer_overlap_cpu(tmp_path):
    doc = _run("layer_overlap.py", "--shapes", "70B_tp8_fc1,8B_tp4_fc2,tiny:64:24:40:rs",
               "--scale", "64", "--kn-scale", "64", "--reps", "2", "--warmup", "1",
               "--methods", "ring_exchange,pipeline:2,pipeline:4/2s", out=tmp_path)
    assert doc["benchmark"] == "layer_overlap" and doc["all_checks_passed"]
    meta = doc["meta"]
    assert meta["mode"] == "cpu" and meta["functional_only"] and meta["ranks"] == 2
    assert meta["backends"] == ["torch_p2p"] and "symm" in meta["skipped_backends"]
    for key in ("torch", "date", "gpu_count", "dist_backend"):
        assert key in meta
    assert [s["shape"]["name"] for s in doc["shapes"]] == ["70B_tp8_fc1", "8B_tp4_fc2", "tiny"]
    expected = {"ag": {"baseline", "gemm", "floor/ring_exchange", "torch_p2p/ring_exchange"},
                "rs": {"baseline", "gemm", "floor/ring_exchange", "torch_p2p/ring_exchange",
                       "floor/pipeline:2", "torch_p2p/pipeline:2", "floor/pipeline:4/2s",
                       "torch_p2p/pipeline:4/2s"}}
    for s in doc["shapes"]:
        arms = s["arms"]
        assert set(arms) == expected[s["shape"]["op"]], set(arms)
        assert "torch_async_tp" in s["skipped"]  # CUDA-only ops
        for name, a in arms.items():
            assert a["error"] is None, (name, a["error"])
            assert len(a["samples_s"]) == 2 and len(a["per_rank_samples_s"]) == 2
            assert a["time_s"]["median"] > 0
            if a["kind"] == "overlap":
                assert a["check"]["passed"] and a["check"]["max_rel_err"] <= 1e-5
                assert a["floor"] == "floor/" + a["method"] and "hidden_fraction" in a
            else:
                assert a["check"] is None
    assert doc["shapes"][0]["shape"]["m"] == 8192 // 64  # --scale shrank M


def test_layer_overlap_over_emulated_nodes(tmp_path):
    """4 ranks as 2 emulated nodes of 2: the per-peer transport with the hierarchical
    ring order (checked against the baseline), next to NCCL's (here gloo's) flat path."""
    doc = _run("layer_overlap.py", "--tp", "4", "--gpus-per-node", "2", "--shapes",
               "tiny:64:24:40:ag,tiny2:64:24:40:rs", "--reps", "1", "--warmup", "1",
               "--methods", "ring_exchange,ring_exchange+agg,pipeline:4,bulk", out=tmp_path)
    assert doc["all_checks_passed"]
    assert doc["meta"]["emulated_nodes"] == "2 x 2 ranks"
    assert doc["meta"]["backends"] == ["hierarchical", "torch_p2p"]
    for s in doc["shapes"]:
        arms = s["arms"]
        rings = {"ag": ["ring_exchange"], "rs": ["ring_exchange", "pipeline:4"]}[s["shape"]["op"]]
        for m in rings:  # the hierarchical order, against a floor that runs it too
            a = arms[f"hierarchical/{m}"]
            assert a["ring_order"] == "hierarchical 2x2" and a["check"]["passed"], a
            assert a["floor"] == f"floor/{m}@2x2" and arms[a["floor"]]["kind"] == "floor"
            assert "ring_order" not in arms[f"torch_p2p/{m}"]
            assert arms[f"torch_p2p/{m}"]["floor"] == f"floor/{m}"
        assert "ring_order" not in arms["hierarchical/bulk"]  # no ring: no ring order
        if s["shape"]["op"] == "ag":
            assert "hierarchical/ring_exchange+agg" in s["skipped"]
            assert "torch_p2p/ring_exchange+agg" in arms


def test_step_ab_cpu(tmp_path):
    doc = _run("step_ab.py", "--layers", "1", "--hidden", "64", "--heads", "4", "--seq", "32",
               "--vocab", "128", "--steps", "3", "--warmup", "1", out=tmp_path)
    assert doc["benchmark"] == "step_ab" and doc["parity_passed"]
    assert doc["meta"]["mode"] == "cpu" and doc["model"]["hidden"] == 64
    arms = doc["arms"]
    assert set(arms) == {"megatron", "overlap_torch_p2p", "compute_only"}
    assert arms["overlap_torch_p2p"]["parity"]["passed"]
    assert arms["overlap_torch_p2p"]["losses"] == pytest.approx(arms["megatron"]["losses"], rel=1e-5)
    assert arms["compute_only"]["parity"] is None and arms["compute_only"]["backend"] == "null"
    for a in arms.values():
        assert len(a["losses"]) == 3 and len(a["step_times_s"]) == 3
        assert a["step_time_s"]["n"] == 2  # warmup left out of the medians
    assert "hidden_fraction" in arms["overlap_torch_p2p"]
    # every arm runs the same core attention, named in its results
    assert {a["attention"] for a in arms.values()} == {"torch's fused attention in 1 of 1 layers"}


# -- the pieces, in process -------------------------------------------------------------------

def test_hidden_fraction_and_summary():
    assert hidden_fraction(10.0, 6.0, 5.0) == pytest.approx(0.8)
    assert hidden_fraction(10.0, 12.0, 5.0) == pytest.approx(-0.4)
    assert hidden_fraction(5.0, 5.0, 5.0) is None  # nothing measured to hide
    s = summary([3.0, 1.0, 2.0, 4.0])
    assert s["median"] == 2.5 and s["q1"] <= s["median"] <= s["q3"] and s["n"] == 4


def test_rotation_gives_every_arm_every_position():
    names = ["a", "b", "c"]
    firsts = {rotated(names, r)[0] for r in range(3)}
    assert firsts == set(names) and all(sorted(rotated(names, r)) == names for r in range(5))


@pytest.mark.parametrize("n", range(2, 9))
def test_balanced_orders_put_each_arm_after_each_other_equally(n):
    """A plain rotation keeps every arm's predecessor fixed (the GPU state an arm starts
    in); the design varies it: over one design, every arm in every position equally, and
    every ordered pair of arms adjacent equally (once for even n, twice for odd)."""
    rounds = balanced_orders(n)
    assert len(rounds) == (n if n % 2 == 0 else 2 * n)
    assert all(sorted(r) == list(range(n)) for r in rounds)
    for pos in range(n):
        assert Counter(r[pos] for r in rounds) == Counter({a: len(rounds) // n for a in range(n)})
    pairs = Counter((r[i], r[i + 1]) for r in rounds for i in range(n - 1))
    assert set(pairs) == {(a, b) for a in range(n) for b in range(n) if a != b}
    assert set(pairs.values()) == {1 if n % 2 == 0 else 2}


@pytest.mark.parametrize("n", range(0, 9))
def test_serial_order_puts_each_arm_right_after_each_other_once(n):
    """time_interleaved's calls: read as a cycle (it is repeated), every ordered pair of
    distinct arms adjacent exactly once, no arm right after itself, each arm n - 1 times."""
    seq = serial_order(n)
    assert len(seq) == n * (n - 1) if n > 1 else seq == [0] * n
    if n > 1:
        pairs = Counter(zip(seq, seq[1:] + seq[:1]))
        assert pairs == Counter({(a, b): 1 for a in range(n) for b in range(n) if a != b})
        assert Counter(seq) == Counter({a: n - 1 for a in range(n)})


def test_methods_and_shapes():
    ms = parse_methods("ring_exchange,ring_exchange+agg,pipeline,pipeline:8/2s,bulk")
    assert [m.label for m in ms] == ["ring_exchange", "ring_exchange+agg", "pipeline:4",
                                     "pipeline:8/2s", "bulk"]
    assert Method("pipeline", 4).applies("ag", 8, 1024) == "n/a"
    assert Method("ring_exchange", aggregate=True).applies("ag", 2, 1024)  # nothing to aggregate
    assert Method("pipeline", 3).applies("rs", 2, 1024)  # rows do not split
    assert Method("pipeline", 4).applies("rs", 2, 1024) is None
    with pytest.raises(SystemExit):
        parse_methods("nope")
    assert len(parse("all")) == 7 and parse("x:64:8:8:ag")[0].op == "ag"
    s = scaled(BY_NAME["70B_tp8_fc1"], 8, 1000, 4)
    assert s.m == 64 and s.k == 2048 and s.n == 1792  # M stays a multiple of tp x 8


def test_backend_selection_by_layout():
    from megatron_overlap.ab.backends import select

    assert select("auto", Layout("cpu", 2, 0))[0] == ["torch_p2p"]
    assert select("auto", Layout("shared_gpu", 2, 1))[0] == ["symm"]
    run, skipped = select("auto", Layout("gpus", 8, 8))
    assert "symm" in run and "torch_p2p" in run
    assert ("nvshmem" in run) != ("nvshmem" in skipped)
    assert select("symm,torch_p2p", Layout("cpu", 2, 0)) == (["torch_p2p"], {"symm": "needs CUDA tensors"})


def test_host_time_cpu(tmp_path):
    """host_time.py end to end on CPU (functional only: there are no GPU launches to time):
    every layer's passes, the four linears chained with one backward, and Megatron's own
    linears on a one-rank group beside them."""
    out = tmp_path / "host_time.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "host_time.py"),
                           "--device", "cpu", "--backend", "torch_p2p", "--tp", "2", "--hidden", "64",
                           "--tokens", "64", "--reps", "2", "--inner", "2", "--dtype", "float32",
                           "--out", str(out)], capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "FUNCTIONAL ONLY" in proc.stdout
    (row,) = json.loads(out.read_text())["rows"]
    for mode in ("eager", "replay"):
        assert set(row[mode]) == {"qkv", "proj", "fc1", "fc2"}
        for v in row[mode].values():
            assert v["fwd_us"] > 0 and v["bwd_b2b_us"] > 0
            assert v["fwd_staggered_us"] is None  # gloo's waits block the host: no turns on CPU
    for arm in ("chain_eager", "chain_replay", "chain_megatron"):
        assert row[arm]["concurrent"]["fwd_us"] > 0 and row[arm]["concurrent"]["bwd_us"] > 0
    assert row["chain_megatron"]["staggered"]["bwd_us"] > 0  # no communication: turns work
    # --report prints the tables of that file again (a run cut short keeps its finished TPs)
    shown = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "host_time.py"),
                            "--report", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert shown.returncode == 0, shown.stderr[-2000:]
    table = [ln.split() for ln in shown.stdout.splitlines()]
    fc2 = next(ln for ln in table if ln[:3] == ["2", "fc2", "replay"])
    assert float(fc2[3]) == round(row["replay"]["fc2"]["fwd_us"])
    assert any(ln[:2] == ["2", "megatron"] for ln in table)


def test_host_time_a_stage_past_its_timeout_says_where_and_the_next_tp_runs(tmp_path):
    """--stage-timeout: a stage that outlasts it dumps every rank's stack (where a hang is)
    and ends that TP's run; the run goes on to the next TP (here every stage is too slow
    for 10 ms: both TPs fail at their first stage, and the run itself still ends)."""
    out = tmp_path / "host_time.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "host_time.py"),
                           "--device", "cpu", "--backend", "torch_p2p", "--tp", "2", "2", "--hidden", "64",
                           "--tokens", "64", "--reps", "1", "--inner", "1", "--dtype", "float32",
                           "--stage-timeout", "0.01", "--out", str(out)],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.count("TP=2 FAILED after") == 2, proc.stdout
    assert "  TP=2 build" in proc.stdout
    for rank in (0, 1):  # each rank's stacks, labelled, from its own file (then removed)
        stacks = proc.stdout.split(f"--- TP=2 rank {rank}: stacks\n")
        assert len(stacks) == 3, proc.stdout  # both runs
        assert "thread 0x" in stacks[1].lower() and "host_time.py" in stacks[1], stacks[1]
    assert not out.exists()  # no TP finished
    assert not list(tmp_path.glob("*.stacks"))


def test_host_time_a_rank_ended_by_the_launcher_still_leaves_its_stacks(tmp_path):
    """The rank that hangs is usually not the first whose timer fires: the launcher ends it
    (SIGTERM) when another rank exits. It still writes where it was."""
    import signal
    import time

    out = str(tmp_path / "ht.json")
    code = ("import sys, time; sys.path.insert(0, 'benchmarks'); import host_time as h; "
            f"h._stage_s = 600.0; h._watch_stages({out!r}, 3); h._stage('a stage that hangs'); "
            "print('ready', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == -signal.SIGTERM
    stacks = (tmp_path / "ht.json.rank3.stacks").read_text()
    assert "thread 0x" in stacks.lower() and "<string>" in stacks, stacks  # where it slept


def _small_tune(tmp_path, *flags: str) -> dict:
    """A model-only tune of a tiny model (`flags` add to / override --tp 2); its JSON."""
    from megatron_overlap.cli import main

    search = tmp_path / "tune.json"
    assert main(["tune", "--hidden-size", "64", "--ffn-hidden-size", "128",
                 "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "1",
                 "--tp", "2", *flags, "--measure", "model", "--yaml", str(tmp_path / "tune.yaml"),
                 "--json", str(search), "--no-cache", "--wandb", "off", "--no-progress"]) == 0
    return json.loads(search.read_text())


def _tune_check():
    """benchmarks/tune_check.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("tune_check", os.path.join(ROOT, "benchmarks",
                                                                             "tune_check.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_host_time_turns_capture_nothing_and_count_replays_without_captures():
    """host_time's staggered turns make no capture (a signature new there runs eagerly) and
    put every pass's capture_after back, also when a call fails; its replay count leaves out
    the capturing calls (PassGraphs.replays counts every graph launch)."""
    import importlib.util

    from megatron_overlap.overlap.replay import PassGraphs

    spec = importlib.util.spec_from_file_location("host_time", os.path.join(ROOT, "benchmarks",
                                                                            "host_time.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)

    class Layer:
        pass_graphs = {"fprop": PassGraphs("qkv fprop"), "bwd": PassGraphs("qkv bwd")}

    fprop = Layer.pass_graphs["fprop"]
    fprop.replays, fprop.captures = 5, 2  # 2 capturing calls (each also launches), 3 replays
    assert mod._counts({"qkv": Layer(), "megatron's": object()}) == (3, 2)
    with pytest.raises(RuntimeError, match="a call failed"):
        with mod._no_captures(Layer()):
            assert {pg.capture_after for pg in Layer.pass_graphs.values()} == {sys.maxsize}
            raise RuntimeError("a call failed")
    assert {pg.capture_after for pg in Layer.pass_graphs.values()} == {2}


def test_tune_check_times_the_tuners_picks_cpu(tmp_path):
    """benchmarks/tune_check.py rebuilds exactly the passes a tuner JSON chose (settings
    included) and times them through the layer's pass functions; on CPU: functional only."""
    doc, mod = _small_tune(tmp_path), _tune_check()
    search = tmp_path / "tune.json"
    for row, trial in mod.chosen_trials(doc):  # the picked settings, exactly
        assert trial.candidate.to_dict() == row["settings"] and trial.name == row["pass"]
        assert trial.comm_moved == row["comm_moved"]

    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "tune_check.py"),
                           "--device", "cpu", "--reps", "1", "--tune", str(search), "--out", str(out)],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "FUNCTIONAL ONLY" in proc.stdout and "predicted" in proc.stdout
    got = json.loads(out.read_text())
    assert got["meta"]["functional_only"] and got["tune"][0]["mode"] == "model"
    assert [(r["shape"], r["pass"]) for r in got["rows"]] == [(r["shape"], r["pass"])
                                                              for r in doc["chosen"]]
    for r, c in zip(got["rows"], doc["chosen"]):
        assert r["settings"] == c["settings"] and r["predicted_ms"] == c["compute_only_ms"]
        assert r["measured_ms"] > 0 and r["ratio"] == pytest.approx(r["predicted_ms"] / r["measured_ms"])


def test_tune_check_times_an_fp8_tune_in_fp8_cpu(tmp_path, monkeypatch):
    """A tune made with --fp8 hybrid is checked in FP8: every pass through its FP8 trial
    pass (the precision read back from the tune's shapes; every wgrad too, fp8_wgrad on),
    and the reference is the whole FP8 GEMM in the pass's first-operand type."""
    pytest.importorskip("torchao", reason="the [fp8] extra (torchao) is not installed")
    import torch

    from megatron_overlap.tune import passes

    doc, mod = _small_tune(tmp_path, "--fp8", "hybrid"), _tune_check()
    seen = []
    monkeypatch.setattr(mod, "trial_pass", lambda *a, **k: seen.append(k["precision"]) or
                        passes.trial_pass(*a, **k))
    monos, real_mono = [], mod.mono_gemm
    monkeypatch.setattr(mod, "mono_gemm", lambda *a, **k: monos.append(k["dtype"]) or real_mono(*a, **k))
    for row, trial in mod.chosen_trials(doc):
        got = mod.measure(trial, "cpu", reps=1)
        assert got["graph_ms"] > 0 and got["mono_ms"] > 0
    assert len(seen) == len(doc["chosen"]) and all(
        p is not None and p.fp8 and p.fwd == torch.float8_e4m3fn and p.grad == torch.float8_e5m2
        and p.wgrad for p in seen)
    passes_ = [row["pass"].rsplit("_", 1)[1] for row in doc["chosen"]]
    assert monos == [torch.float8_e4m3fn if p == "fprop" else torch.float8_e5m2 for p in passes_]


def test_tune_check_compares_each_side_with_its_own_monolithic_gemm(tmp_path, monkeypatch):
    """rel_ratio takes the prediction relative to the tuner's monolithic GEMM of that pass
    (the median of the tune's timings of that GEMM size and operand layout, as its cost
    model takes it) and the measurement relative to the one timed beside it: a GPU that
    runs every GEMM 20% slower than during the tune leaves rel_ratio at 1 where ratio says
    0.83. A bulk or external pick is reported apart from the chunked ones."""
    doc, mod = _small_tune(tmp_path), _tune_check()
    assert all(r["rel_ratio"] is None for r in mod.check(doc, "cpu", 1, 1))  # model-only: no monos
    groups: dict = {}
    for t in doc["trials"]:
        groups.setdefault((tuple(t["gemm"]), t["pass"].rsplit("_", 1)[1]), []).append(t)
    for trials in groups.values():  # timings of one GEMM whose median (2.0) is not the first
        for t, ms in zip(trials, [1.0, 2.0, 9.0] if len(trials) >= 3 else [2.0]):
            t["measured_mono_graph_ms"] = ms
    assert any(len(trials) >= 3 for trials in groups.values())
    chosen = {(c["shape"], c["pass"]): c["compute_only_ms"] for c in doc["chosen"]}
    monkeypatch.setattr(mod, "measure", lambda trial, device, reps, rounds: {
        "graph_ms": 1.2 * chosen[(trial.spec.shape.name, trial.name)], "b2b_ms": 1.0,
        "mono_ms": 2.4})
    rows = mod.check(doc, "cuda", 1, 1)
    assert rows and all(r["tuner_mono_ms"] == 2.0 for r in rows)
    for r in rows:
        assert r["ratio"] == pytest.approx(1 / 1.2) and r["rel_ratio"] == pytest.approx(1.0)
        assert r["chunked"] == (r["settings"]["method"] not in ("bulk", "external"))
    assert {r["chunked"] for r in rows} == {True, False}
    assert mod.rescore(doc, rows) == rows  # scored again from its measurements alone
    changed = [dict(r, settings={**r["settings"], "num_splits": 99}) if i == 0 else r
               for i, r in enumerate(rows)]
    with pytest.raises(ValueError, match="no earlier row timed .* with the picked settings"):
        mod.rescore(doc, changed)  # another pick's timing is never taken for this one


def test_tune_check_times_hierarchical_picks_in_their_ring_order(tmp_path, monkeypatch):
    """A model-only tune whose TP group spans nodes (TP 4 on nodes of 2 GPUs: --gpus-per-node,
    LOCAL_WORLD_SIZE's role in a real run) picks hierarchical rings; tune_check hands their
    passes the ranks per node the tuner and the layer use, and the flat ones none."""
    from megatron_overlap.simulate.passes import ring_order_of

    doc, mod = _small_tune(tmp_path, "--tp", "4", "--gpus-per-node", "2"), _tune_check()
    seen = []
    real = mod.trial_pass

    def spy(trial, tp, device, dtype, **kw):
        seen.append((trial.name, kw.get("nodes")))
        return real(trial, tp, device, dtype, **kw)

    monkeypatch.setattr(mod, "trial_pass", spy)
    rows = mod.check(doc, "cpu", 1)
    orders = {trial.name: ring_order_of(trial.candidate.settings, trial.candidate.layout)
              for _, trial in mod.chosen_trials(doc)}
    assert "hierarchical" in orders.values()  # the case this test is for
    assert [n for n, _ in seen] == [r["pass"] for r in doc["chosen"]]
    for (name, nodes), row in zip(seen, rows):
        want = [[0, 1], [2, 3]] if orders[name] == "hierarchical" else None
        assert nodes == want and row["nodes"] == want, (name, orders[name])
        assert row["measured_ms"] > 0


def test_host_python_replays_on_cpu():
    """host_python.py (the replay path's Python side on CPU) runs and does measure replays:
    after the capture, every call of both layers, bf16 and FP8, goes through PassGraphs.run's
    replay."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "host_python.py"),
                           "--calls", "30", "--reps", "1"], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.split()[:2] in (
        ["bf16", "qkv"], ["bf16", "proj"], ["fp8", "qkv"], ["fp8", "proj"])]
    assert len(lines) == 4, proc.stdout  # both layers, in bf16 and in FP8
    for ln in lines:
        fprop = int(ln.split("'fprop': ")[1].split(",")[0])
        assert fprop >= 30, ln  # the 30 timed forwards all replayed (plus warm-up replays)
        bwd = int(ln.split("'bwd': ")[1].split("}")[0])
        assert bwd >= 30, ln
