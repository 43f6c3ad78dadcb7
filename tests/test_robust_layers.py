"""Inputs checked at the layer's door (TP=2, gloo): what Megatron's own layer takes
(non-contiguous, 2-D, no input grad, no_grad, the empty sequence) gives Megatron's
result; what it cannot take is refused before any transfer, naming the layer, what
was expected, what came and the fix; and the next valid call, on every rank, still
equals Megatron's, also when only one rank made the bad call. The same cases run
on CUDA tensors in tests/gpu/test_faults_symm.py (helpers.robust holds them)."""

import pytest

from helpers import dist
from helpers.robust import (ACCEPTED, KINDS, REFUSED, check_accepted, check_one_rank_refused,
                            check_refused, door, one_rank_refused)

TP = 2
ENV = {"MEGATRON_OVERLAP_TIMEOUT_S": "20"}  # a broken case fails in seconds, never hangs
_cache: dict = {}


def _results(fn):
    if fn.__name__ not in _cache:
        per_rank = dist.run(fn, TP, env=ENV, timeout=180)
        _cache[fn.__name__] = per_rank
    return _cache[fn.__name__]


@pytest.mark.parametrize("kind,sp,name", REFUSED, ids=lambda v: str(v))
def test_bad_input_is_refused_at_the_door_then_the_next_call_works(kind, sp, name):
    check_refused(_results(door), kind, sp, name)


@pytest.mark.parametrize("kind,sp", [(k, s) for k, s, _ in KINDS], ids=lambda v: str(v))
@pytest.mark.parametrize("name", ACCEPTED)
def test_inputs_megatron_takes_give_megatrons_result(kind, sp, name):
    check_accepted(_results(door), kind, sp, name)


@pytest.mark.parametrize("kind,sp", [(k, s) for k, s, _ in (KINDS[0], KINDS[2])],
                         ids=lambda v: str(v))
def test_one_rank_refused_alone_leaves_no_trace(kind, sp):
    check_one_rank_refused(_results(one_rank_refused), kind, sp)
