"""Every wait bounded (TP=2, gloo, MEGATRON_OVERLAP_TIMEOUT_S=2): a peer that raises
(and stays alive, silent) or whose process ends, before the first forward, inside
any of the four layer kinds' forward or backward, or between the two, gives the
other rank a CommError naming rank, layer pass, chunk and peer within the timeout
plus a small slack. Every case runs under a harness deadline that kills the ranks."""

import re

import pytest

from helpers.faults import exit_case, raise_case, run_ranks
from helpers.robust import KINDS, kind_id

TP, T, SLACK = 2, 2.0, 4.0
ENV = {"MEGATRON_OVERLAP_TIMEOUT_S": str(T)}
POINTS = ("forward", "backward", "between")
RAISE_CASES = [(kind, sp, variant, p) for kind, sp, variant in KINDS[:1]
               for p in ("first_forward", "topology")] + [
    (kind, sp, variant, point) for kind, sp, variant in KINDS for point in POINTS]

PASS_ERROR = re.compile(r"CommError: megatron_overlap\[torch_p2p\]: rank 0/2 waited for "
                        r"'(qkv|proj)_(fprop|dgrad|wgrad)' chunk (\d+) \((all ranks|to 1, from 1)\)"
                        r" and it failed: .*MEGATRON_OVERLAP_TIMEOUT_S=2s")


def _check_pass_error(got: dict, kind: str, point: str, transfers: dict) -> None:
    if point != "forward" and transfers["backward"] == 0:  # row without SP: no wait is left
        assert got["result"] == "no error", got
        return
    m = PASS_ERROR.match(got["result"])
    assert m, got["result"]
    layer, pass_ = m.group(1), m.group(2)
    assert layer == ("qkv" if kind == "column" else "proj")
    fails_in_forward = point == "forward" and transfers["forward"] > 0
    assert (pass_ == "fprop") == fails_in_forward, (point, transfers, got["result"])


@pytest.mark.parametrize("case", RAISE_CASES, ids=lambda c: f"{kind_id(c[0], c[1])}-{c[3]}")
def test_a_peer_that_raises_is_a_bounded_diagnosed_timeout(case):
    kind, sp, _, point = case
    per_rank = run_ranks(raise_case, TP, case, env=ENV, timeout=60)
    bad = {r: v for r, v in enumerate(per_rank) if v[0] != "ok"}
    assert not bad, "\n".join(f"rank {r} {s}: {v}" for r, (s, v) in bad.items())
    survivor, victim = (v for _, v in per_rank)
    assert victim["result"].startswith("Injected: injected failure"), victim
    if survivor["result"] != "no error":  # only its own timeout can have told it
        assert T * 0.9 <= survivor["elapsed"] <= T + SLACK, survivor
    if point in ("first_forward", "topology"):
        what = {"first_forward": "layer agreement (shape and settings)",
                "topology": "topology exchange before the first forward"}[point]
        assert survivor["result"].startswith(
            f"CommError: megatron_overlap: rank 0/2 waited for '{what}' chunk 0 (from all ranks) "
            f"2s and group ranks 1 (global 1) never arrived"), survivor
        assert "a rank without install()" in survivor["result"]
    else:
        _check_pass_error(survivor, kind, point, survivor["transfers"])


EXIT_CASES = [  # (case, victim)
    (("column", True, "rs_dgrad_pipeline2", "first_forward"), 1),
    (("row", True, "pipeline2", "first_forward"), 0),  # the rank that hosts the store
    (("row", True, "pipeline2", "forward"), 1),
    (("column", True, "rs_dgrad_pipeline2", "backward"), 1),
    (("row", True, "pipeline2", "between"), 1),
]


@pytest.mark.parametrize("case,victim", EXIT_CASES,
                         ids=lambda c: f"{kind_id(c[0], c[1])}-{c[3]}" if isinstance(c, tuple)
                         else f"victim{c}")
def test_a_peer_whose_process_ends_is_a_bounded_diagnosed_error(case, victim):
    kind, _, _, point = case
    per_rank = run_ranks(exit_case, TP, case, victim, env=ENV, timeout=60)
    assert per_rank[victim] == ("exited", 17), per_rank[victim]
    status, survivor = per_rank[1 - victim]
    assert status == "ok", survivor
    assert survivor["elapsed"] <= T + SLACK, survivor
    if point != "first_forward":
        _check_pass_error(survivor, kind, point, survivor["transfers"])
    elif victim == 1:
        assert "'layer agreement (shape and settings)' chunk 0 (from all ranks) 2s and " \
               "group ranks 1 (global 1) never arrived" in survivor["result"], survivor
    else:
        assert survivor["result"].startswith(
            "CommError: megatron_overlap: rank 1/2 waited for 'layer agreement (shape and "
            "settings)' chunk 0 (from all ranks) 2s and the rendezvous store (hosted by global "
            "rank 0) is unreachable"), survivor
