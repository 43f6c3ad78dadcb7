"""The FP8 tools on CPU: the tuner's passes in FP8 (`tune.passes.fp8_trial_pass`, what
benchmarks/fp8_compute.py times) compute what the independent FP8 reference computes from
the same FP8 operands, for every trial of a column and a row layer on 2 gloo ranks; and
the three FP8 benchmarks run at tiny sizes (functional only), reporting their goals.

Bounds: bit-equal where nothing is summed over ranks (a chunk GEMM's rows are the whole
GEMM's rows on CPU), 1e-6 relative (fp32, world - 1 additions in another order) where the
pass reduces."""

import json
import math
import os
import statistics
import subprocess
import sys

import pytest

from helpers import dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fp8_trials(rank, world):
    from helpers.tune_ranks import fp8_trial_passes_match_reference

    return fp8_trial_passes_match_reference(rank, world)


def test_fp8_trial_passes_compute_the_fp8_reference():
    for rows in dist.run(_fp8_trials, 2, timeout=200):
        assert {r["pass"] for r in rows} == {"qkv_fprop", "qkv_dgrad", "qkv_wgrad",
                                             "proj_fprop", "proj_dgrad", "proj_wgrad"}
        for r in rows:
            assert r["fp8"] and r["errors"], r
            for key, (err, summed) in r["errors"].items():
                assert err <= (1e-6 if summed else 0.0), (r["pass"], r["label"], key, err)


def _run(*args):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)


def test_fp8_compute_cpu(tmp_path):
    r = _run("benchmarks/fp8_compute.py", "--device", "cpu", "--reps", "1", "--repeat", "1",
             "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.load(open(tmp_path / "fp8_compute_cpu.json"))
    assert len(doc["rows"]) == 24 and doc["meta"]["note"] == "CPU: FUNCTIONAL ONLY"
    assert {r["pass"] for r in doc["rows"]} == {"fprop", "dgrad", "wgrad"}
    assert "goal: fp8 chunked >= 0.93 of fp8 whole" in r.stdout
    # the whole GEMM with the pass's own work: a wgrad's transpose, a ring reduce-scatter's
    # sum (the row layers' forwards picked as rings); nothing for the other passes
    for row in doc["rows"]:
        ring_rs = (row["pass"] == "fprop" and ("proj" in row["shape"] or "fc2" in row["shape"])
                   and row["pick"].startswith("ring"))
        own = row["pass"] == "wgrad" or ring_rs
        assert (row["fp8_whole_own_ms"] is not None) == own, row
    assert any(row["pass"] == "fprop" and row["fp8_whole_own_ms"] is not None for row in doc["rows"])


def test_fp8_layer_cpu(tmp_path):
    r = _run("benchmarks/fp8_layer.py", "--shapes", "tiny", "--device", "cpu", "--profile", "3",
             "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    row = json.load(open(tmp_path / "fp8_layer_cpu.json"))["rows"][0]
    assert row["check"]["passed"] and row["check"]["precision"]["fp8"][0].startswith("fp8 tensorwise")
    # the eager-kernel arm and the later-micro-batch arm (its FP8 weights reused) compute the
    # fp8 arm's numbers (on CPU both run torch's kernels: equal)
    assert row["check"]["fp8_arms_max_rel"] == 0.0
    assert set(row["kernels"]) == {"bf16", "fp8", "fp8_eager_kernels", "fp8_later_micro",
                                   "fp8_delayed", "fp8_accum_none", "fp8_accum_all",
                                   "fp8_unfused_act", "fp8_delayed_unfused_act"}
    # the arms of other accumulations say so; on CPU (one accumulation) as far from bf16 as fp8
    for arm, said in (("fp8", "fprop"), ("fp8_accum_none", "none"),
                      ("fp8_accum_all", "fprop, dgrad, wgrad")):
        assert row["check"]["precision"][arm][0].endswith(f"fast accumulation: {said})")
    assert all(v == row["check"]["max_rel_err"] for v in row["check"]["accum_max_rel_err"].values())
    # Megatron's SwiGLU (bf16, then the linears' casts) in the FP8 arms that keep it; the
    # fused one everywhere else: as far from bf16 as the fp8 arm, not its bits
    mlp = row["check"]["mlp"]
    assert mlp["bf16"] == mlp["fp8_unfused_act"] == mlp["fp8_delayed_unfused_act"] == "MLP"
    assert mlp["fp8"] == mlp["fp8_delayed"] == "OverlapMLP"
    unfused = row["check"]["unfused_act_max_rel_err"]
    assert all(1e-3 < v <= row["check"]["tol_rel_norm"] and v != row["check"]["max_rel_err"]
               for v in unfused.values()), unfused
    # delayed scaling (Megatron's default recipe) moved by FP8's rounding too, no more
    assert row["check"]["precision"]["fp8_delayed"][0].startswith("fp8 delayed")
    assert 1e-3 < row["check"]["delayed_max_rel_err"] <= row["check"]["tol_rel_norm"]
    assert all(k["total_us"] > 0 and len(k["top"]) == 3 for k in row["kernels"].values())
    # FP8 moved the results, by FP8's rounding: not an arm that silently ran bf16
    assert 1e-3 < row["check"]["max_rel_err"] <= row["check"]["tol_rel_norm"], row["check"]


def test_a_replays_timeline_splits_it_by_what_runs_beside_the_gemms():
    """benchmarks/graph_timeline.py's arithmetic (fp8_layer --profile, attention_layer
    --timeline) on a replay laid out by hand (us): two GEMMs on two streams, a cast before
    them, a copy under the first and past its end, a gap."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import graph_timeline

    ev = lambda ts, dur, stream, name: dict(ts=ts, dur=dur, stream=stream, name=name)  # noqa: E731
    t = graph_timeline.replay_timeline([
        ev(100.0, 10.0, 7, "cast_t"),                       # alone: 10 outside the GEMMs
        ev(110.0, 40.0, 7, "nvjet_sm90_gemm_a"),            # GEMMs 110-150 and 130-170
        ev(130.0, 40.0, 9, "nvjet_sm90_gemm_b"),
        ev(140.0, 50.0, 11, "Memcpy DtoD (Device -> Device)"),  # 20 of it past the GEMMs
        ev(200.0, 5.0, 7, "delayed_update"),                # after a 10 us gap
    ])
    assert t["span_us"] == 105.0 and t["streams"] == 3
    assert t["kernel_sum_us"] == 145.0
    assert t["busy_us"] == 95.0  # 100-190 and 200-205
    assert t["gemm_busy_us"] == 60.0
    assert t["groups"]["copy"] == {"sum_us": 50.0, "outside_gemm_us": 20.0}
    assert t["groups"]["other"] == {"sum_us": 15.0, "outside_gemm_us": 15.0}
    assert [k[:3] for k in t["kernels"]] == [[0, 0.0, 10.0], [0, 10.0, 40.0], [1, 30.0, 40.0],
                                             [2, 40.0, 50.0], [0, 100.0, 5.0]]


def test_fp8_train_cpu(tmp_path):
    r = _run("benchmarks/fp8_train.py", "--device", "cpu", "--layers", "2", "--hidden", "64",
             "--heads", "4", "--seq", "32", "--micro-batch", "2", "--vocab", "128", "--steps", "4",
             "--last", "2", "--agree-every", "2", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    doc = json.load(open(tmp_path / "fp8_train_cpu.json"))
    bf16, fp8 = doc["arms"]["bf16"], doc["arms"]["fp8"]
    assert len(bf16["losses"]) == len(fp8["losses"]) == 4
    assert fp8["precision"].startswith("fp8 tensorwise") and bf16["precision"] == "bf16"
    assert bf16["losses"] != fp8["losses"]  # FP8 ran
    assert abs(doc["gap"]["relative"]) < 0.05, doc["gap"]  # same model, FP8 rounding apart
    assert (tmp_path / "fp8_train_cpu.txt").read_text().startswith("fp8_train:")
    # every step ran each arm's 8 linears forward and backward (2 layers x 4), eagerly here
    assert bf16["passes"] == fp8["passes"] == {"calls": 4 * 2 * 4 * 2, "replays": 0, "captures": 0}
    # causality: bf16 earlier positions do not see later tokens at all; FP8 only through its
    # per-tensor scales (amaxes over every position), far less than the later positions move
    assert bf16["future_leak"]["before_middle_max"] == 0.0 < bf16["future_leak"]["after_middle_mean"]
    leak = fp8["future_leak"]
    assert leak["before_middle_mean"] < leak["after_middle_mean"] / 10, leak
    # 4 steps learn nothing of sequences never trained on: about log(vocab) for both
    assert all(abs(a["future_leak"]["unseen_loss"] - math.log(128)) < 1.0 for a in (bf16, fp8))
    # the next token (the label) reaches no earlier logit: bf16 exactly, FP8 by its scales
    look16, look8 = bf16["lookahead"], fp8["lookahead"]
    assert look16["at_after"] > 0 and all(v == 0.0 for k, v in look16.items() if k != "at_after")
    assert all(v < look8["at_after"] / 10 for k, v in look8.items() if k != "at_after"), look8
    # same weights and batch before the first step: FP8 moved the logits and every
    # gradient by its rounding (~4% and ~8% here), no pass by more
    ag = doc["agreement"]
    assert 1e-3 < ag["logits_rel"] < 0.15, ag["logits_rel"]
    assert len(ag["grad_rel"]) > 10  # every parameter of both layers, the embedding, norms
    assert 0 < ag["grad_rel_median"] and ag["grad_rel_worst"][0][1] < 0.3, ag["grad_rel_worst"]
    # the agreement on the FP8 arm's weights at step 2: as close as before the first step
    (along,) = doc["agreement_along"]
    assert along["step"] == 2 and 1e-3 < along["grad_rel_median"] < 0.3, along
    # each arm's trained weights scored in each arm's model: a model given the other arm's
    # weights scores otherwise than on its own (the weights were loaded), by about FP8's
    # rounding; each model has its own weights back after
    cross = doc["crossover"]
    assert cross.pop("restored") is True
    assert len(cross) == 4 and max(cross.values()) - min(cross.values()) < 0.05, cross
    for m in ("bf16", "fp8"):
        assert cross[f"bf16 weights, {m} model"] != cross[f"fp8 weights, {m} model"], cross
    # the parameters TP does not split (norms, row biases) stayed one tensor on both ranks
    for a in (bf16, fp8):
        assert a["replica_spread"]["compared"] > 0 and a["replica_spread"]["max_abs"] == 0.0
        assert a["replica_spread"]["param"] is None


def test_markov_batches_follow_their_chain():
    """Every label is one of its token's `branching` distinct successors, each of them
    seen, so the loss floor is log(branching); the same seed gives the same batches, and
    labels are the tokens shifted by one."""
    import torch

    from megatron_overlap.ab.model import GPTSpec, markov_batches

    spec, cpu = GPTSpec(1, 64, 4, 32, 4, 40, None), torch.device("cpu")
    seen: dict = {}
    for tokens, pos, mask, labels in markov_batches(spec, 100, 7, cpu, branching=3):
        assert torch.equal(tokens[:, 1:], labels[:, :-1]) and tokens.shape == (4, 32)
        for a, b in zip(tokens.flatten().tolist(), labels.flatten().tolist()):
            seen.setdefault(a, set()).add(b)
    assert len(seen) == spec.vocab and {len(v) for v in seen.values()} == {3}
    a, b = (next(markov_batches(spec, 1, s, cpu))[0] for s in (7, 7))
    assert torch.equal(a, b) and not torch.equal(a, next(markov_batches(spec, 1, 8, cpu))[0])
    with pytest.raises(ValueError, match="branching"):
        next(markov_batches(spec, 1, 7, cpu, branching=0))


def test_fp8_train_on_markov_data_learns_the_chain(tmp_path):
    """--data markov: both arms train on the chain, identically fed (the same first loss
    up to FP8's rounding), and learn it (the loss falls well below log(vocab))."""
    r = _run("benchmarks/fp8_train.py", "--device", "cpu", "--layers", "1", "--hidden", "64",
             "--heads", "4", "--seq", "32", "--micro-batch", "4", "--vocab", "32", "--steps",
             "40", "--last", "5", "--lr", "3e-3", "--data", "markov", "--agree-every", "0",
             "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    doc = json.load(open(tmp_path / "fp8_train_cpu.json"))
    assert "markov data" in doc["title"] and doc["config"]["data"] == "markov"
    for a in doc["arms"].values():
        assert abs(a["losses"][0] - math.log(32)) < 0.5, a["losses"][:3]
        assert statistics.fmean(a["losses"][-5:]) < math.log(32) - 1.0, a["losses"][-5:]


def test_fp8_train_checks_leave_training_as_it_is(tmp_path):
    """The agreement check on the FP8 arm's weights, run between steps, changes neither
    arm's losses: the bf16 arm gets its own weights back, the layers their flags."""
    losses = []
    for every in ("0", "1"):
        r = _run("benchmarks/fp8_train.py", "--device", "cpu", "--layers", "1", "--hidden", "64",
                 "--heads", "4", "--seq", "16", "--micro-batch", "2", "--vocab", "64", "--steps",
                 "3", "--last", "1", "--agree-every", every, "--out", str(tmp_path / every))
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
        doc = json.load(open(tmp_path / every / "fp8_train_cpu.json"))
        assert len(doc["agreement_along"]) == (0 if every == "0" else 2)
        losses.append({k: a["losses"] for k, a in doc["arms"].items()})
    assert losses[0] == losses[1]


def test_probe_fp8_tp_checks_every_fp8_pass(tmp_path):
    """benchmarks/probe_fp8_tp.py: at TP=2 + SP every FP8 GEMM, shared amax, gathered FP8
    tensor and reduction of the first steps is checked, and on CPU each agrees (the CPU's
    scaled GEMM computes what the fp32 reference does; amaxes and gathered rows exactly)."""
    r = _run("benchmarks/probe_fp8_tp.py", "--device", "cpu", "--layers", "2", "--hidden", "64",
             "--heads", "4", "--seq", "32", "--micro-batch", "2", "--vocab", "128", "--steps", "2",
             "--last", "1", "--probe-steps", "1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for rank in (0, 1):
        checks = json.load(open(tmp_path / f"probe_fp8_tp_probe_rank{rank}.json"))["checks"]
        ops = [f"{n}_{p}" for n in ("qkv", "proj", "fc1", "fc2") for p in ("fprop", "dgrad", "wgrad")]
        assert {f"gemm {op}: |fp8 - fp32| / |fp32|" for op in ops} <= set(checks), sorted(checks)
        # the gathered FP8 tensors (the column layers' inputs, the row layers' output grads)
        # and the row layers' reductions, each layer once (2 layers)
        for op in ("qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad"):
            assert checks[f"{op}: gathered rows wrong (share)"]["count"] == 2
            assert checks[f"{op}: output vs the true rows' product"]["count"] == 2
            assert checks[f"{op}_amax: |shared - true| / true"]["count"] == 2
        for op in ("proj_fprop", "fc2_fprop"):
            assert checks[f"{op}: output vs every rank's product summed"]["count"] == 2
        # the column dgrads' bulk gathers of the FP8 input (for the wgrads) and their
        # reduce-scatters, through the transport
        for op in ("qkv", "fc1"):
            assert checks[f"{op}_dgrad (bulk gather): rows wrong (share)"]["count"] == 2
            assert checks[f"{op}_wgrad (bulk reduce-scatter): vs the process group's"]["count"] == 2
        assert all(c["count"] > 0 for c in checks.values()), checks
        # products and sums against fp32 ones (the same numbers on CPU), rows and amaxes exact
        exact = [k for k in checks if "rows wrong" in k or "amax" in k]
        assert all(checks[k]["worst"] == 0.0 for k in exact), checks
        assert all(c["worst"] < 1e-6 for c in checks.values()), checks


PLANTED = """
import sys
sys.path.insert(0, {bench!r})
import probe_fp8_tp


def worker(rank, world, args):
    import megatron_overlap.layers.functions as functions

    real = functions.all_gather_matmul

    def shifted(x, w, tp, method, **kw):  # the GEMM's rows one position late: a leak
        out, gathered = real(x, w, tp, method, **kw)
        out.copy_(out.roll(-args.micro_batch, 0))
        return out, gathered

    functions.all_gather_matmul = shifted
    probe_fp8_tp.worker(rank, world, args)


if __name__ == "__main__":
    import probe_fp8_tp as p
    p.worker = worker
    sys.exit(p.main())
"""


def test_probe_fp8_tp_sees_a_planted_row_shift(tmp_path):
    """The probe's checks can fail: outputs of the all-gather GEMMs shifted by one position
    (what a look-ahead leak would be) move its product check by O(1) while the gathered
    rows stay right, and the look-ahead check of fp8_train sees the next token."""
    script = tmp_path / "planted.py"
    script.write_text(PLANTED.format(bench=os.path.join(ROOT, "benchmarks")))
    r = _run(str(script), "--device", "cpu", "--layers", "2", "--hidden", "64", "--heads", "4",
             "--seq", "32", "--micro-batch", "2", "--vocab", "128", "--steps", "2", "--last", "1",
             "--probe-steps", "1", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    checks = json.load(open(tmp_path / "probe_fp8_tp_probe_rank0.json"))["checks"]
    assert checks["qkv_fprop: output vs the true rows' product"]["worst"] > 0.5, checks
    assert checks["qkv_fprop: gathered rows wrong (share)"]["worst"] == 0.0, checks
    look = json.load(open(tmp_path / "fp8_train_cpu.json"))["arms"]["fp8"]["lookahead"]
    assert look["j-1"] > look["at_after"] / 10, look


def test_fp8_train_rowwise_is_exactly_causal(tmp_path):
    """Row-wise scales are per token: no logit sees a later token at all (unlike the
    per-tensor scales' amax over every position), so the look-ahead check is exact."""
    r = _run("benchmarks/fp8_train.py", "--device", "cpu", "--dtype", "bfloat16", "--layers", "2",
             "--hidden", "64", "--heads", "4", "--seq", "32", "--micro-batch", "2", "--vocab", "128",
             "--steps", "2", "--last", "1", "--fp8-scaling", "rowwise", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    fp8 = json.load(open(tmp_path / "fp8_train_cpu.json"))["arms"]["fp8"]
    assert fp8["precision"].startswith("fp8 rowwise"), fp8["precision"]
    look = fp8["lookahead"]
    assert look["at_after"] > 0 and all(v == 0.0 for k, v in look.items() if k != "at_after"), look


def test_layer_ledger_counts_what_the_fp8_layer_adds(tmp_path):
    """benchmarks/layer_ledger.py at the tiny shape: both arms' GEMMs are the layer's four
    linears' forward, dgrad and wgrad (2 x tokens x per-rank weights each, counted from the
    shapes the ledger recorded, not assumed), the bf16 arm casts and transposes nothing,
    and of the three transposed copies per linear its FP8 GEMMs need (the dgrad's weight,
    the wgrad's two operands) only the gathered operand's is a kernel of its own, found at
    its site in the code; the others come out of their casts' kernels."""
    r = _run("benchmarks/layer_ledger.py", "--shapes", "tiny", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    row = json.load(open(tmp_path / "layer_ledger_fp8_cpu.json"))["rows"][0]
    d, tp, tokens = row["dims"], row["tp"], row["tokens"]
    head = d["hidden"] // d["heads"]
    per_rank = d["hidden"] * ((d["heads"] + 2 * d["query_groups"]) * head  # qkv
                              + d["heads"] * head  # proj
                              + 3 * d["ffn_hidden"]) // tp  # fc1 (SwiGLU: two halves), fc2
    for arm in ("bf16", "fp8"):
        assert row["totals"][arm]["gemm"]["gflop"] * 1e9 == pytest.approx(6 * tokens * per_rank), arm
    bf16, fp8 = row["totals"]["bf16"], row["totals"]["fp8"]
    assert bf16["fp8 cast"]["launches"] == 0
    sites = sorted(o["site"] for o in row["ops"]["fp8"] if o["cls"] == "transpose"
                   and o["site"].startswith("overlap/fp8.py:transposed"))
    # the gathered operands (qkv's and fc1's input, proj's and fc2's gradient) in the wgrad;
    # the weights', the row layers' inputs' and the column layers' grads' after their casts
    assert sites == ["overlap/fp8.py:transposed <- layers/fp8.py:col_major"] * 4, sites
    assert fp8["transpose"]["launches"] == bf16["transpose"]["launches"] + 4
    casts = [o for o in row["ops"]["fp8"] if o["cls"] == "fp8 cast"]
    assert len(casts) == 12  # per linear: input and weight, then the grad
    # each reads its bf16 tensor (2 bytes an element) and its amaxes (the TP group's for
    # the gathered tensors: the column inputs, the row gradients), writes its scale pair (8
    # bytes) and 1 byte an element: the gathered tensors in one layout, the 6 others in
    # both (cast-transpose: 2 bytes); no scale kernel of their own. fc2's input and fc1's
    # gradient come out of the SwiGLU's kernels, in both layouts, from fc1's output (2 x
    # 2 bytes an element of fc2's input) and, for the gradient, fc2's input gradient
    one = [o for o in casts if o["name"] == "compiled current_cast"]
    both = [o for o in casts if o["name"] == "compiled current_cast_t"]
    assert len(one) == 4 and len(both) == 6, casts
    assert all(o["written"] - 8 == (o["read"] - 4 * tp) // 2 for o in one), one
    assert all(o["written"] - 8 == o["read"] - 4 for o in both), both
    act = {o["name"]: o for o in casts if o["name"].startswith("fused ")}
    assert set(act) == {"fused swiglu cast", "fused swiglu_grad cast"}, casts
    assert act["fused swiglu cast"]["written"] - 8 == (act["fused swiglu cast"]["read"] - 4) // 2
    g = act["fused swiglu_grad cast"]
    assert (g["written"] - 8) * 3 == (g["read"] - 4) * 2  # reads g and y: 2 + 4 bytes, writes 2 x 2
    assert all(act[n]["site"].startswith("overlap/fp8_act.py") for n in act), act
    assert not [o for o in row["ops"]["fp8"] if o["name"] in ("compiled scale", "reciprocal")]
    assert "fp8's largest sites of the rest" in r.stdout
    assert fp8["comm"]["mib"] < bf16["comm"]["mib"]  # the gathers move FP8


def test_layer_ledger_counts_what_reusing_the_fp8_weights_saves(tmp_path):
    """benchmarks/layer_ledger.py --pair fp8_micro at the tiny shape: at a step's later
    micro-batches (the FP8 weight cache in use) each of the four linears skips its weight's
    amax and its cast, which writes the dgrad's transposed copy too, and nothing else
    changes (the same GEMMs, transposes of gathered tensors, transfers and copies)."""
    r = _run("benchmarks/layer_ledger.py", "--pair", "fp8_micro", "--shapes", "tiny",
             "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    row = json.load(open(tmp_path / "layer_ledger_fp8_micro_cpu.json"))["rows"][0]
    every, later = row["totals"]["fp8"], row["totals"]["fp8_later_micro"]
    assert row["check"]["passed"], row["check"]
    for cls in ("fp8 cast", "reduction"):
        assert later[cls]["launches"] == every[cls]["launches"] - 4, (cls, every[cls], later[cls])
    for cls in ("gemm", "comm", "copy", "transpose"):
        assert later[cls] == every[cls], cls
