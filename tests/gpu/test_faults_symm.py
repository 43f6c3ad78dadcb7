"""Issue 16's fault, door and disagreement cases on the `symm` transport, ranks sharing
one GPU (gloo process group, TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1): the very
cases the CPU suite runs (tests/test_robust_{faults,layers,disagree}.py; the tables
and what each rank must see live in helpers.faults, helpers.robust, helpers.disagree),
here on CUDA tensors; and the accuracy of symm's bf16 reduce-scatter against fp64.

- A peer that raises (alive, silent) or whose process ends, before the first forward,
  in each of the four layer kinds' forward and backward, or between the two: the
  other ranks get a CommError naming rank, layer pass, chunk and peer within
  MEGATRON_OVERLAP_TIMEOUT_S plus a slack. GPU waits are enqueued, so the survivor
  learns of it from the transport's check() (what its next layer call runs), polled
  by helpers.faults.settle, never from a synchronize: with Megatron's
  CUDA_DEVICE_MAX_CONNECTIONS=1 no release reaches the stuck stream, a synchronize
  would return only when the device-side timeout traps (1.5 T), and the rank leaves
  without one (the harness ends it after it reported). Passes run eagerly
  (MEGATRON_OVERLAP_GRAPHS=0) so that a fault lands inside a pass, at a chunk; a peer
  missing from a replayed pass is tests/gpu/test_replay.py's.
- Inputs at the layer's door (wrong device, dtype, shape; accepted ones against
  Megatron's layer), and ranks that disagree (token counts, settings, no install()).

Every case runs under the harness deadline (helpers.faults.run_ranks kills the ranks).
On one H200 the file takes about 4 minutes."""

import pytest
import torch

from helpers import disagree, gpu, reduction
from helpers.faults import (EXIT_CASES, case_id, check_exited, check_raised, exit_case,
                            raise_case, raise_cases, run_ranks)
from helpers.robust import (ACCEPTED, KINDS, REFUSED, check_accepted, check_one_rank_refused,
                            check_refused, door, one_rank_refused)

TP, T, SLACK, DEADLINE = 2, 5.0, 4.0, 45  # a case takes about 10 s
ENV = {**gpu.ENV, "MEGATRON_OVERLAP_TIMEOUT_S": f"{T:g}"}
EAGER = {**ENV, "MEGATRON_OVERLAP_GRAPHS": "0"}  # the fault cases: see the docstring
_cache: dict = {}


def _ok(per_rank: list) -> list:
    bad = {r: v for r, v in enumerate(per_rank) if v[0] != "ok"}
    assert not bad, "\n".join(f"rank {r} {s}: {v}" for r, (s, v) in bad.items())
    return [v for _, v in per_rank]


# -- peers that fail -------------------------------------------------------------------------
@pytest.mark.parametrize("case", raise_cases(), ids=case_id)
def test_a_peer_that_raises_is_a_bounded_diagnosed_timeout(case):
    per_rank = run_ranks(raise_case, TP, case, "cuda", env=EAGER, timeout=DEADLINE)
    check_raised(per_rank, case, "symm", T, SLACK)


def test_a_peer_that_raises_at_tp4_leaves_every_other_rank_a_diagnosis():
    case = ("row", True, "pipeline2", "between")  # every other rank: its dgrad's pass barrier
    per_rank = run_ranks(raise_case, 4, case, "cuda", env=EAGER, timeout=DEADLINE)
    check_raised(per_rank, case, "symm", T, SLACK)


@pytest.mark.parametrize("case,victim", EXIT_CASES,
                         ids=lambda c: case_id(c) if isinstance(c, tuple) else f"victim{c}")
def test_a_peer_whose_process_ends_is_a_bounded_diagnosed_error(case, victim):
    per_rank = run_ranks(exit_case, TP, case, victim, "cuda", env=EAGER, timeout=DEADLINE)
    check_exited(per_rank, case, victim, "symm", T, SLACK)


# -- ranks that disagree ---------------------------------------------------------------------
@pytest.mark.parametrize("what", disagree.WHAT)
def test_ranks_that_disagree_are_diagnosed(what):
    per_rank = run_ranks(disagree.disagree_case, TP, what, "cuda", env=ENV, timeout=DEADLINE)
    disagree.check(what, per_rank, T, SLACK)


# -- inputs at the layer's door (pass replay on, as in training) -----------------------------
def _results(fn):
    if fn.__name__ not in _cache:
        _cache[fn.__name__] = _ok(run_ranks(fn, TP, "cuda", env=ENV, timeout=2 * DEADLINE))
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


# -- reduction accuracy ----------------------------------------------------------------------
@pytest.mark.parametrize("world", [2, 4, 8])
def test_symm_bf16_reduce_scatter_is_within_the_fp32_accumulate_bound(world, capsys):
    """symm's reduce-scatter of bf16 partials against the fp64 sum: every element
    within the bound of an fp32 accumulation rounded once (which a bf16 sum in rank
    order breaks at TP=4), and no less accurate than that bf16 sum or a ring."""
    per_rank = _ok(run_ranks(reduction.symm_reduce_scatter, world, "bfloat16", 4,
                             env=gpu.ENV, timeout=DEADLINE))
    with capsys.disabled():
        for rank, r in enumerate(per_rank):
            print(f"\nsymm reduce-scatter bf16 TP={world} rank {rank}: relative error vs fp64 "
                  f"ours max {max(r['ours']):.3e} (elements over the fp32-accumulate bound: "
                  f"{r['over_bound']}; equal to the fp64 sum rounded once: {r['exact']}), "
                  f"bf16 sum in rank order max {max(r['rank_order']):.3e} "
                  f"({r['rank_order_over_bound']} over the bound), ring in bf16 max "
                  f"{max(r['ring']):.3e}")
    for r in per_rank:
        assert r["over_bound"] == 0, r
        assert max(r["ours"]) <= reduction.UNIT[torch.bfloat16], r
        assert sum(r["ours"]) <= sum(r["rank_order"]) and sum(r["ours"]) <= sum(r["ring"]), r
    if world > 2:  # more additions, more roundings: the bound is one they break
        assert sum(r["rank_order_over_bound"] for r in per_rank) > 0, per_rank
