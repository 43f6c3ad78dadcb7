"""The overlap schedules, written once against `comm.Transport`."""

from .ag_gemm import all_gather_matmul, ring_steps
from .bulk import hide
from .gemm import Gemm, matmul
from .gemm_rs import matmul_reduce_scatter

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "ring_steps", "hide", "Gemm", "matmul"]
