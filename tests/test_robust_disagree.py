"""Ranks that disagree are diagnosed, not crashed (TP=2, gloo): different token
counts or settings for one layer raise DisagreementError on every rank, naming the
ranks and what differs, before any transfer, and the next agreeing call works; a
rank that runs Megatron's own layer (no install()) leaves the others a bounded
diagnosis that names that possible cause. The same cases run on CUDA tensors in
tests/gpu/test_faults_symm.py (helpers.disagree holds them)."""

import pytest

from helpers import disagree
from helpers.faults import run_ranks

TP, T = 2, 2.0
ENV = {"MEGATRON_OVERLAP_TIMEOUT_S": str(T)}


@pytest.mark.parametrize("what", disagree.WHAT)
def test_ranks_that_disagree_are_diagnosed(what):
    per_rank = run_ranks(disagree.disagree_case, TP, what, env=ENV, timeout=60)
    disagree.check(what, per_rank, T)
