"""A/B runs and benchmarks: the same model, seed and batches (or the same layer
inputs) on Megatron's plain TP path, on the overlap per backend and on the
compute-only floor, run side by side, with loss / output parity and medians.

- `train`, `report`, `limits`: the A/B main job's training arm, its report, and what
  a run on this machine can show (said in the report).
- `launch`, `machine`: ranks on any machine (GPUs, a shared GPU, CPU) and what ran.
- `model`: the GPT of the end-to-end runs; `shapes`, `layer_arms`, `async_tp`: the
  per-layer benchmark's arms (their floor: the schedule on `comm.NullTransport`);
  `emulated_tp`: one process playing a TP rank (the whole-layer benchmark); `timing`,
  `results`, `plots`: measuring and writing; `compare`: the one relative error every
  check reports (the benchmarks' and the tests').

A tool: imports the runtime and `simulate` (the shapes); matplotlib, rich and wandb
only through `extras.require` ([ab]).
"""

from .report import write_report
from .train import StepResult, TrainArm

__all__ = ["TrainArm", "StepResult", "write_report"]
