"""Reductions at least as accurate as NCCL's: the heap transports (`symm`,
`nvshmem`) sum half-precision partials in fp32 and round once; a ring in the data
type (NCCL's reduce-scatter on bf16/fp16) rounds once per hop. Both against an
fp64 sum of the same partials, at TP = 2, 4 and 8."""

from __future__ import annotations

import pytest
import torch

from megatron_overlap.comm.heap import sum_in_rank_order


def _partials(world: int, dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Each rank's partial sum, as a GEMM would hand it over: rounded to `dtype`."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(4096, 64, generator=g).mul(4).to(dtype) for _ in range(world)]


def _ring(parts: list[torch.Tensor], owner: int) -> torch.Tensor:
    """A ring reduce-scatter's sum for `owner`'s block: hop by hop, in the data type,
    starting at the rank after the owner."""
    world = len(parts)
    acc = parts[(owner + 1) % world].clone()
    for hop in range(2, world + 1):
        acc = acc + parts[(owner + hop) % world]  # one rounding per hop
    return acc


def rel_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_heap_sum_rounds_once_and_beats_a_ring_in_the_data_type(world, dtype):
    ours_err, ring_err = [], []
    for seed in range(4):
        parts = _partials(world, dtype, seed)
        ref = sum(p.double() for p in parts)
        out = torch.empty_like(parts[0])
        sum_in_rank_order(out, lambda p: parts[p], world)
        assert torch.equal(out, ref.to(dtype))  # exactly the fp64 sum, rounded once
        ours_err.append(rel_error(out, ref))
        ring_err.append(rel_error(_ring(parts, owner=seed % world), ref))
    unit = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11  # half an ulp, relative
    assert max(ours_err) <= unit
    assert sum(ours_err) <= sum(ring_err)
    if world > 2:  # more hops, more roundings: strictly worse
        assert sum(ours_err) < sum(ring_err)


def test_fp32_sums_in_rank_order_unchanged():
    parts = _partials(4, torch.float32, 0)
    out = torch.empty_like(parts[0])
    sum_in_rank_order(out, lambda p: parts[p], 4)
    assert torch.equal(out, ((parts[0] + parts[1]) + parts[2]) + parts[3])
