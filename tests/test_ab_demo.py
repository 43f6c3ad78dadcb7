"""`make demo`'s job, shortened: both arms train, the losses agree, the console fits
two screens (the compact settings table; the full one in the output folder), the
report says what a CPU run cannot show and where the GPU figures are, and one offline
wandb run per arm (one group) is written and read back."""

import glob
import os
import subprocess
import sys

from megatron_overlap.ab.limits import RESULTS
from megatron_overlap.telemetry import read_offline_run, wait_for_exit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_ab_overlap_writes_report_and_wandb_runs(tmp_path):
    out = tmp_path / "ab"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "ab_overlap.py"), "--steps", "4",
         "--hidden", "64", "--seq", "32", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = (proc.stdout + proc.stderr).splitlines()
    assert len(printed) <= 120, "\n".join(printed)  # two screens, set-up excluded
    assert "report:" in proc.stdout and "wandb:" in proc.stdout
    assert "A_megatron" in proc.stdout and "B_overlap" in proc.stdout  # the arms, said up front
    # which attention each arm ran: the same in both, so the A/B measures the overlap
    assert "attention   A and B: torch's fused attention in 2 of 2 layers" in proc.stdout, proc.stdout
    # the compact settings table: one line per linear and pass, idle keys in one legend line
    assert sum("mlp.linear_fc1" in line for line in printed) == 1, proc.stdout
    assert sum(line.startswith("No effect on any pass here:") for line in printed) == 1
    full = (out / "settings.txt").read_text()  # the full table: every layer, every reason
    assert "decoder.layers.1.mlp.linear_fc1" in full and "Keys without effect, and why:" in full
    assert "fc1_fprop:" in (out / "settings.yaml").read_text()
    report = (out / "report.md").read_text()
    assert "## What this run can show" in report and "Not its speed. On CPU" in report, report
    assert "docs/results.md" in report and "megatron-overlap simulate" in report, report
    assert os.path.exists(os.path.join(ROOT, RESULTS))  # where the report points
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
