"""Reduction accuracy against an fp64 reference (tests/test_reduction.py on CPU,
tests/gpu/test_faults_symm.py on `symm`): each rank's partial sum, the sums a ring and
a plain data-type sum in rank order would give, and the bound of a sum accumulated in
fp32 and rounded once."""

from __future__ import annotations

import torch

from megatron_overlap.ab.compare import rel_error

# unit roundoff (half an ulp, relative) of the data types the heap transports sum in fp32
UNIT = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 2.0 ** -24}


def partials(world: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Each rank's partial sum, as a GEMM would hand it over: rounded to `dtype` (the
    same on every rank that asks, on the CPU)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4096, 64, generator=g).mul(4).to(dtype) for _ in range(world)]


def ring(parts: list[torch.Tensor], owner: int) -> torch.Tensor:
    """A ring reduce-scatter's sum for `owner`'s block: hop by hop, in the data type,
    starting at the rank after the owner."""
    world = len(parts)
    acc = parts[(owner + 1) % world].clone()
    for hop in range(2, world + 1):
        acc = acc + parts[(owner + hop) % world]  # one rounding per hop
    return acc


def in_rank_order(parts: list[torch.Tensor]) -> torch.Tensor:
    """((p0 + p1) + p2) + ..., in the data type: one rounding per addition."""
    acc = parts[0].clone()
    for p in parts[1:]:
        acc = acc + p
    return acc




def fp32_bound(parts: list[torch.Tensor], ref: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per element, the most a sum accumulated in fp32 and rounded once to `dtype` may
    differ from the exact sum `ref`: the fp32 additions' error, (n - 1) u32 sum|p|,
    then one rounding of that to `dtype`, u |ref| (plus u of the fp32 error)."""
    n, u = len(parts), UNIT[dtype]
    acc32 = (n - 1) * UNIT[torch.float32] * sum(p.double().abs() for p in parts)
    return u * ref.abs() + (1 + u) * acc32 * (1 + 1e-6)


def symm_reduce_scatter(rank: int, world: int, dtype_name: str, seeds: int) -> dict:
    """This rank's block of the `symm` transport's reduce-scatter of the partials
    (ranks sharing one GPU), against fp64, the fp32-accumulate bound, a bf16 sum in
    rank order and a ring in the data type: relative errors per seed."""
    from helpers import gpu

    gpu.init(per_gpu=False)
    tp = gpu.symm(timeout_s=10)
    dtype = getattr(torch, dtype_name)
    out: dict = {"ours": [], "rank_order": [], "ring": [], "over_bound": 0,
                 "rank_order_over_bound": 0, "exact": True}
    for seed in range(seeds):
        parts = partials(world, dtype, seed)
        rows = parts[0].shape[0] // world
        blocks = [p[rank * rows:(rank + 1) * rows] for p in parts]
        ref = sum(b.double() for b in blocks)
        tp.begin_pass("rs_accuracy")
        got = torch.empty(rows, parts[0].shape[1], dtype=dtype, device="cuda")
        tp.reduce_scatter(got, parts[rank].cuda(), op="rs_accuracy").wait()
        got = got.cpu()  # (a drained stream: every wait above has finished)
        tp.check()
        bound, plain = fp32_bound(blocks, ref, dtype), in_rank_order(blocks)
        out["over_bound"] += int(((got.double() - ref).abs() > bound).sum())
        out["rank_order_over_bound"] += int(((plain.double() - ref).abs() > bound).sum())
        out["exact"] &= bool(torch.equal(got, ref.to(dtype)))  # the fp64 sum, rounded once
        out["ours"].append(rel_error(got, ref))
        out["rank_order"].append(rel_error(plain, ref))
        out["ring"].append(rel_error(ring(blocks, rank), ref))
    return out
