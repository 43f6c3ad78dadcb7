"""A/B runs: the same model, seed and batches on Megatron's plain TP path and on
the overlap, stepped side by side, with a report of loss parity and step times."""

from .report import write_report
from .train import StepResult, TrainArm

__all__ = ["TrainArm", "StepResult", "write_report"]
