"""Cost model of the overlap schedules: predicts each TP layer pass's overlapped
time, exposed communication and a step-time estimate against the
non-overlapped path (GEMM, then the NCCL collective), from GEMM times (measured
on one GPU, or a roofline) and link bandwidths and latencies. Owns the layer
shapes (`shapes`: DESIGN.md's reference shapes, the presets). It times the
schedules by running `overlap`'s own code on every TP rank, on a modelled
transport and GEMM seam over meta tensors (`transport`), then playing what each
rank issued on an event model of the GPUs and links (`play`, `timeline`). A tool:
imports `config`, `comm` and `overlap`; never Megatron or a tool's extra.

    from megatron_overlap.simulate import Hardware, Layout, parse_shapes, simulate
    report = simulate(parse_shapes("70b", tp=16), Hardware(), Layout(tp=16, gpus_per_node=8))
"""

from .api import ModelSummary, Report, ShapeResult, simulate
from .calibration import Calibration
from .gemm import GemmModel, roofline_us
from .hardware import BACKENDS, MODES, Hardware, Layout
from .passes import PassResult, PassSpec, layer_passes, simulate_pass
from .shapes import PRESETS, REFERENCE, ModelDims, Shape, parse_shapes
from .space import Candidate, Trial, candidates, choose, trials, ub_cfgs

__all__ = [
    "Hardware", "Layout", "MODES", "BACKENDS", "Calibration", "GemmModel",
    "roofline_us", "Shape", "ModelDims", "REFERENCE", "PRESETS", "parse_shapes", "PassSpec",
    "PassResult", "layer_passes", "simulate_pass", "Candidate", "Trial", "candidates", "trials",
    "choose", "ub_cfgs", "simulate", "Report", "ShapeResult", "ModelSummary",
]
