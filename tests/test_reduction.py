"""Reductions at least as accurate as NCCL's: the heap transports (`symm`,
`nvshmem`) sum half-precision partials in fp32 and round once; a ring in the data
type (NCCL's reduce-scatter on bf16/fp16) rounds once per hop. Both against an
fp64 sum of the same partials, at TP = 2, 4 and 8. On the GPU: the `symm`
transport's own reduce-scatter, tests/gpu/test_faults_symm.py."""

from __future__ import annotations

import pytest
import torch

from helpers.reduction import UNIT, fp32_bound, in_rank_order, partials, rel_error, ring
from megatron_overlap.comm.heap import sum_in_rank_order


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_heap_sum_rounds_once_and_beats_a_ring_in_the_data_type(world, dtype):
    ours_err, ring_err = [], []
    for seed in range(4):
        parts = partials(world, dtype, seed)
        ref = sum(p.double() for p in parts)
        out = torch.empty_like(parts[0])
        sum_in_rank_order(out, lambda p: parts[p], world)
        assert torch.equal(out, ref.to(dtype))  # exactly the fp64 sum, rounded once
        bound = fp32_bound(parts, ref, dtype)
        assert ((out.double() - ref).abs() <= bound).all()
        if world > 2:  # the bound is tight enough to fail: a sum in the data type breaks it
            assert ((in_rank_order(parts).double() - ref).abs() > bound).any()
        ours_err.append(rel_error(out, ref))
        ring_err.append(rel_error(ring(parts, owner=seed % world), ref))
    assert max(ours_err) <= UNIT[dtype]
    assert sum(ours_err) <= sum(ring_err)
    if world > 2:  # more hops, more roundings: strictly worse
        assert sum(ours_err) < sum(ring_err)


def test_fp32_sums_in_rank_order_unchanged():
    parts = partials(4, torch.float32, 0)
    out = torch.empty_like(parts[0])
    sum_in_rank_order(out, lambda p: parts[p], 4)
    assert torch.equal(out, ((parts[0] + parts[1]) + parts[2]) + parts[3])
