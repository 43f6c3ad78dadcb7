"""Per-layer autotuner: searches every valid overlap setting of every TP layer
pass, measures each on the hardware at hand (several GPUs: the real
overlapped pass; one GPU: the GEMM side, with the cost model for the
communication; CPU: the cost model only, and says so), and writes the fastest
(within 1%: the least compute side, `simulate.choose`) as a TE ub_cfgs YAML. A
tool: imports the runtime and `simulate`; wandb and rich only through
`extras.require` ([wandb], [tools]). Measured trials run the
layers' own pass functions (`tune.passes`, imported where a measure needs it).

    from megatron_overlap.simulate import Hardware, Layout, PRESETS
    from megatron_overlap.tune import ModelMeasure, tune
    layout = Layout(tp=8)
    result = tune(PRESETS["70b"].shapes("70B", 8), layout, ModelMeasure(Hardware(), layout))
    result.write_yaml("ub_cfgs.yaml")
"""

from .cache import Cache, cache_key
from .hooks import ComputeSideMeasure, DistributedMeasure, ModelMeasure, job_of
from .tuner import TuneResult, tune

__all__ = ["tune", "TuneResult", "Cache", "cache_key", "ModelMeasure", "ComputeSideMeasure",
           "DistributedMeasure", "job_of"]
