"""Drop-in overlapped TP linear layers and their autograd functions."""

from .linear import OverlapColumnParallelLinear, OverlapRowParallelLinear
from .plan import LayerPlan, build_plan

__all__ = ["OverlapColumnParallelLinear", "OverlapRowParallelLinear", "LayerPlan", "build_plan"]
