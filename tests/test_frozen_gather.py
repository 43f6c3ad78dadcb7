"""Frozen weights and the last-dim gathers run our own overlapped path (bounded waits),
never Megatron's fallback, and equal Megatron's own layer on the same weights: frozen
weights (LoRA-style; the bias trainable or not; the input with or without grad) at
TP 2 and 4, SP on and off, over a representative subset of the schedules: outputs and
input grads equal, weight.grad None on both, the bias grad equal to the one Megatron's
trainable layer gives; gather_output / runtime_gather_output and a row layer's unsplit
input (fwd and input grad)."""

import pytest

from helpers import dist
from helpers.layers import MODES, mode_cases, mode_id, run_modes

TP_SIZES = (2, 4)
TOL = 1e-5
_results: dict[int, list[dict]] = {}


def _results_for(tp: int) -> list[dict]:
    if tp not in _results:  # one set of processes per TP size runs every case
        _results[tp] = dist.run(run_modes, tp, mode_cases(), timeout=300)
    return _results[tp]


@pytest.mark.parametrize("tp,mode,case", [pytest.param(tp, m, c, id=f"tp{tp}-{mode_id(m, c)}")
                                          for tp in TP_SIZES for m, c in mode_cases()])
def test_matches_megatron(tp, mode, case):
    cid = mode_id(mode, case)
    m = MODES[mode]
    for rank, per_rank in enumerate(_results_for(tp)):
        got = per_rank[cid]
        assert not got["ours_uses_megatron"], f"rank {rank}: {cid} ran Megatron's fallback"
        assert got["output_shape"][0] == got["output_shape"][1], got
        bad = {k: v for k, v in got["errors"].items() if not v <= TOL}
        assert not bad, f"rank {rank} {cid}: relative errors above {TOL}: {bad}"
        none = got["none"]
        assert none["output"] == (False, False)
        assert none["input_grad"] == (not m.get("input_grad", True),) * 2, none
        if m.get("weight", True) is False:
            assert none["weight_grad"] == (True, True), none  # frozen: no grad on either
        else:
            assert none["weight_grad"] == (False, False), none
        trains_bias = case.bias and not case.skip_bias_add and m.get("bias", True)
        assert none["bias_grad"] == ((not trains_bias,) * 2), none
