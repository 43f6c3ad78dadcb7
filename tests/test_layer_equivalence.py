"""Our drop-in layers against Megatron's own ColumnParallelLinear / RowParallelLinear
on the same weights, inputs and upstream gradients: output, input grad, weight
grad and bias grad, for every schedule, TP 1/2/4, SP on/off, fp32 and bf16, bias
on/off and skip_bias_add, over micro-batches of three different lengths."""

import pytest

from helpers import dist
from helpers.layers import TOL, all_cases, run_cases

TP_SIZES = (1, 2, 4)
_results: dict[int, dict] = {}


def _results_for(tp: int) -> dict:
    if tp not in _results:  # one set of processes per TP size runs every case
        per_rank = dist.run(run_cases, tp, all_cases(tp), timeout=600)
        _results[tp] = {cid: {k: max(r[cid][k] for r in per_rank) for k in per_rank[0][cid]}
                        for cid in per_rank[0]}
    return _results[tp]


@pytest.mark.parametrize("tp,case", [(tp, c) for tp in TP_SIZES for c in all_cases(tp)],
                         ids=lambda v: f"tp{v}" if isinstance(v, int) else v.id)
def test_matches_megatron(tp, case):
    errors = _results_for(tp)[case.id]
    bad = {k: v for k, v in errors.items() if not v <= TOL[case.dtype]}
    assert not bad, f"TP={tp} {case.id}: relative errors above {TOL[case.dtype]}: {bad}"
