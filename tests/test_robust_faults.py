"""Every wait bounded (TP=2, gloo, MEGATRON_OVERLAP_TIMEOUT_S=2): a peer that raises
(and stays alive, silent) or whose process ends, before the first forward, inside
any of the four layer kinds' forward or backward, or between the two, gives the
other rank a CommError naming rank, layer pass, chunk and peer within the timeout
plus a small slack. Every case runs under a harness deadline that kills the ranks.
The same cases run on `symm` in tests/gpu/test_faults_symm.py (helpers.faults
holds them and what the survivors must see)."""

import pytest

from helpers.faults import (EXIT_CASES, case_id, check_exited, check_raised, exit_case,
                            raise_case, raise_cases, run_ranks)

TP, T, SLACK = 2, 2.0, 4.0
ENV = {"MEGATRON_OVERLAP_TIMEOUT_S": str(T)}


@pytest.mark.parametrize("case", raise_cases(), ids=case_id)
def test_a_peer_that_raises_is_a_bounded_diagnosed_timeout(case):
    per_rank = run_ranks(raise_case, TP, case, env=ENV, timeout=60)
    check_raised(per_rank, case, "torch_p2p", T, SLACK)


@pytest.mark.parametrize("case,victim", EXIT_CASES,
                         ids=lambda c: case_id(c) if isinstance(c, tuple) else f"victim{c}")
def test_a_peer_whose_process_ends_is_a_bounded_diagnosed_error(case, victim):
    per_rank = run_ranks(exit_case, TP, case, victim, env=ENV, timeout=60)
    check_exited(per_rank, case, victim, "torch_p2p", T, SLACK)
