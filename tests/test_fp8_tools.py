"""The FP8 tools on CPU: the tuner's passes in FP8 (`tune.passes.fp8_trial_pass`, what
benchmarks/fp8_compute.py times) compute what the independent FP8 reference computes from
the same FP8 operands, for every trial of a column and a row layer on 2 gloo ranks; and
the three FP8 benchmarks run at tiny sizes (functional only), reporting their goals.

Bounds: bit-equal where nothing is summed over ranks (a chunk GEMM's rows are the whole
GEMM's rows on CPU), 1e-6 relative (fp32, world - 1 additions in another order) where the
pass reduces."""

import json
import os
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


def test_fp8_layer_cpu(tmp_path):
    r = _run("benchmarks/fp8_layer.py", "--shapes", "tiny", "--device", "cpu", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    row = json.load(open(tmp_path / "fp8_layer_cpu.json"))["rows"][0]
    assert row["check"]["passed"] and row["check"]["precision"]["fp8"][0].startswith("fp8 tensorwise")
    # FP8 moved the results, by FP8's rounding: not an arm that silently ran bf16
    assert 1e-3 < row["check"]["max_rel_err"] <= row["check"]["tol_rel_norm"], row["check"]


def test_fp8_train_cpu(tmp_path):
    r = _run("benchmarks/fp8_train.py", "--device", "cpu", "--layers", "2", "--hidden", "64",
             "--heads", "4", "--seq", "32", "--micro-batch", "2", "--vocab", "128", "--steps", "4",
             "--last", "2", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    doc = json.load(open(tmp_path / "fp8_train_cpu.json"))
    bf16, fp8 = doc["arms"]["bf16"], doc["arms"]["fp8"]
    assert len(bf16["losses"]) == len(fp8["losses"]) == 4
    assert fp8["precision"].startswith("fp8 tensorwise") and bf16["precision"] == "bf16"
    assert bf16["losses"] != fp8["losses"]  # FP8 ran
    assert abs(doc["gap"]["relative"]) < 0.05, doc["gap"]  # same model, FP8 rounding apart
    assert (tmp_path / "fp8_train_cpu.txt").read_text().startswith("fp8_train:")
