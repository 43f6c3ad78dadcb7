"""How far one tensor is from a reference: the one measure the A/B checks, the benchmarks'
checks and the tests report, so that their numbers mean the same thing."""

from __future__ import annotations

import torch


def rel_error(got: torch.Tensor, ref: torch.Tensor, norm: str = "fro",
              dtype: torch.dtype = torch.float64) -> float:
    """||got - ref|| / ||ref|| computed in `dtype` (an all-zero `ref`: the error's norm
    over 1e-30). `norm`: 'fro' (Frobenius, over every element) or 'max' (the largest
    |difference| over the largest |ref|: an outlier is not averaged away). float32 halves
    the memory a GPU needs for large tensors; float64 keeps fp32 results' last bits."""
    if norm not in ("fro", "max"):
        raise ValueError(f"rel_error: norm {norm!r}: 'fro' or 'max'")
    g, r = got.to(dtype), ref.to(dtype)
    size = (lambda t: t.norm()) if norm == "fro" else (lambda t: t.abs().max())
    return float(size(g - r) / size(r).clamp_min(1e-30))
