"""torch's async-TP ops, the comparison point: `torch.ops.symm_mem.fused_all_gather_matmul`
and `fused_matmul_reduce_scatter` (micro-pipelined over symmetric memory, CUDA only).

torch < 2.11 needs `enable_symm_mem_for_group` before they run on a group.
2.11 deprecated it (the store comes from the process group) and there it is not
called: it still registers the group with a check that the group is new, which
fails once a symmetric-memory rendezvous (our symm transport's) registered it.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist


def unavailable_reason(device: torch.device) -> str | None:
    """Why the ops cannot run here, or None."""
    if device.type != "cuda":
        return "torch's async-TP ops have CUDA kernels only"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401  (defines the ops)

        torch.ops.symm_mem.fused_all_gather_matmul  # noqa: B018
        torch.ops.symm_mem.fused_matmul_reduce_scatter  # noqa: B018
    except (ImportError, AttributeError, RuntimeError) as exc:
        return f"torch {torch.__version__} lacks them: {exc}"
    return None


def enable(group: dist.ProcessGroup) -> str:
    """Make `group` usable by the ops; returns its name."""
    import torch.distributed._symmetric_memory as symm_mem

    name = group.group_name
    fn = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if fn is None or getattr(fn, "__deprecated__", None):
        return name
    if not symm_mem.is_symm_mem_enabled_for_group(name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            try:
                fn(name)
            except RuntimeError:  # already registered (by a rendezvous on this group)
                pass
    return name


def all_gather_matmul(x: torch.Tensor, w: torch.Tensor, group_name: str) -> torch.Tensor:
    """all_gather(x) @ w.T; x: this rank's [rows, k] block, w: [n, k]."""
    _, outs = torch.ops.symm_mem.fused_all_gather_matmul(x, [w.t()], 0, group_name, return_A=True)
    return outs[0]


def matmul_reduce_scatter(x: torch.Tensor, w: torch.Tensor, group_name: str) -> torch.Tensor:
    """reduce_scatter(x @ w.T) over rows; x: [world * rows, k], w: [n, k]."""
    return torch.ops.symm_mem.fused_matmul_reduce_scatter(x, w.t(), "sum", 0, group_name)
