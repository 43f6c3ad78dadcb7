"""The overlap schedules, written once against `comm.Transport`: AG->GEMM, GEMM->RS,
the hierarchical orders, the backward's bulk overlaps, GEMM streams, SM margin,
pass replay. Imports `config` and `comm`; must not import Megatron, `layers` or a tool."""

from .ag_gemm import all_gather_matmul, ring_steps
from .bulk import hide
from .gemm import Gemm, matmul
from .gemm_rs import matmul_reduce_scatter

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "ring_steps", "hide", "Gemm", "matmul"]
