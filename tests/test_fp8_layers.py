"""OverlapColumnParallelLinear / OverlapRowParallelLinear with Megatron's fp8 config
(fp8='hybrid' or 'e4m3', fp8_recipe='tensorwise', fp8_wgrad on and off, the weight
grad into autograd or accumulated into an fp32 main_grad), every
schedule variant of the bf16 tests, SP on and off, TP 2 and 4, bf16 and fp32
parameters: output, input grad, weight grad and bias grad against the independent FP8
reference (helpers/fp8_ref.py, helpers/fp8_layers.py); and the ring cases at TP 4 over
two emulated nodes, through per-peer transports and the hierarchical orders.

Bounds, and why:
- Bit-equal wherever no reduction over ranks is involved: the column layer's output
  (the gathered FP8 input has the TP group's scale, so it is the whole input quantized
  once, and each chunk GEMM's rows are the whole GEMM's rows), its weight grad (the
  gathered FP8 input again, with this rank's FP8 gradient) and bias grad; the row
  layer's input grad (the gathered FP8 gradient, one scale), weight grad and bias grad.
  With fp8_wgrad off, the weight grad is torch.mm of the params-dtype operands (the
  row layer's: the gathered FP8 gradient dequantized), as the reference computes it;
  into main_grad, the FP8 wgrad GEMM outputs fp32 (main_grad starts at zero).
- Sums over ranks (the column input grad, reduce-scattered or all-reduced; the row
  output, reduce-scattered or all-reduced, plus its bias): each rank's partial product
  is bit-equal to the reference's, only the summation differs. fp32: at most a few
  roundings of 2^-24, so 1e-6 relative (norm). bf16: the reference sums in fp64; ours
  adds bf16 partials (gloo sums in bf16) and rounds the result: at most TP roundings of
  2^-9 each, one more for the row layer's bias add.
"""

import pytest

from helpers import dist
from helpers.fp8_layers import cases, per_peer_cases, run_cases

TP_SIZES = (2, 4)
_results: dict[int, dict] = {}


def _results_for(tp: int) -> list[dict]:
    if tp not in _results:  # one set of processes per TP size runs every case
        _results[tp] = dist.run(run_cases, tp, cases(), timeout=600)
    return _results[tp]


def _reduction_bound(kind: str, dtype: str, tp: int) -> float:
    if dtype == "float32":
        return 1e-6
    return (tp + (1 if kind == "row" else 0)) * 2.0 ** -9


def _check(case, per_rank: list[dict], tp: int) -> None:
    reduced = "input_grad" if case.kind == "column" else "output"
    bound = _reduction_bound(case.kind, case.dtype, tp)
    for rank, r in enumerate(per_rank):
        got = r[case.id]
        assert not got["megatron_forward"] and got["precision"].startswith("fp8 tensorwise"), got
        for key in ("output", "input_grad", "weight_grad", "bias_grad"):
            v = got[key]
            assert v["dtype"], (rank, key, v)
            if key == reduced:
                assert v["rel"] <= bound, (rank, key, v, bound)
            else:
                assert v["equal"], (rank, key, v)


@pytest.mark.parametrize("tp,case", [(tp, c) for tp in TP_SIZES for c in cases()],
                         ids=lambda v: f"tp{v}" if isinstance(v, int) else v.id)
def test_fp8_layer_matches_the_fp8_reference(tp, case):
    _check(case, _results_for(tp), tp)


@pytest.fixture(scope="module")
def per_peer() -> list[dict]:
    return dist.run(run_cases, 4, per_peer_cases(), env={"LOCAL_WORLD_SIZE": "2"}, timeout=400)


@pytest.mark.parametrize("case", per_peer_cases(), ids=lambda c: c.id)
def test_fp8_layer_through_per_peer_transports(per_peer, case):
    _check(case, per_peer, 4)
    for r in per_peer:
        got = r[case.id]
        assert got["transport"] == "hierarchical", got
        assert got["orders"] and all(o == "hierarchical (2x2)" for o in got["orders"].values()), got
