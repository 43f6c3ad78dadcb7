"""Drop-in overlapped TP linear layers and their autograd functions.

Owns: `OverlapColumnParallelLinear` / `OverlapRowParallelLinear` (subclasses of
Megatron's), the autograd functions of their passes, the wgrad accumulation, and
the plan that maps Megatron's `tp_comm_*` flags onto each pass. Imports `config`,
`comm` (which transport, never how bytes move) and `overlap`, and megatron-core.
Must not import the integration (`megatron_overlap.megatron`) or any tool.
"""

from .linear import OverlapColumnParallelLinear, OverlapRowParallelLinear
from .plan import LayerPlan, build_plan

__all__ = ["OverlapColumnParallelLinear", "OverlapRowParallelLinear", "LayerPlan", "build_plan"]
