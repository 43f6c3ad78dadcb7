"""`make demo`'s job, shortened: both arms train, the losses agree, and the report
and one offline wandb run per arm (one group) are written and read back."""

import glob
import os
import subprocess
import sys

from megatron_overlap.telemetry import read_offline_run, wait_for_exit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ab_overlap_writes_report_and_wandb_runs(tmp_path):
    out = tmp_path / "ab"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "ab_overlap.py"), "--steps", "4",
         "--hidden", "64", "--seq", "32", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "report:" in proc.stdout and "linear_fc1" in proc.stdout  # settings table printed
    report = (out / "report.md").read_text()
    rows = {line.split("|")[1].strip(): line.split("|") for line in report.splitlines()
            if line.startswith("| A_") or line.startswith("| B_")}
    assert set(rows) == {"A_megatron", "B_overlap"}
    assert float(rows["B_overlap"][4]) < 1e-5  # max loss difference to the baseline
    assert (out / "report.png").stat().st_size > 10_000
    runs = sorted(glob.glob(str(out / "wandb" / "offline-run-*")))
    assert len(runs) == 2
    for r in runs:
        wait_for_exit(r)
    read = [read_offline_run(r) for r in runs]
    assert {r["config"]["arm"] for r in read} == {"A_megatron", "B_overlap"}
    for r in read:
        assert [h["loss"] for h in r["history"] if "loss" in h].__len__() == 4
    b = next(r for r in read if r["config"]["arm"] == "B_overlap")
    assert "megatron_overlap" in b["config"] and b["tables"]
    assert any(k.startswith("overlap/") for h in b["history"] for k in h)
    losses = [[h["loss"] for h in r["history"] if "loss" in h] for r in read]
    assert losses[0] == losses[1]
