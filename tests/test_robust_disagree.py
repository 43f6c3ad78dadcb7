"""Ranks that disagree are diagnosed, not crashed (TP=2, gloo): different token
counts, settings or a frozen weight for one layer raise DisagreementError on every rank, naming the
ranks and what differs, before any transfer, and the next agreeing call works; a
rank that runs Megatron's own layer (no install()) leaves the others a bounded
diagnosis that names that possible cause. The same cases run on CUDA tensors in
tests/gpu/test_faults_symm.py (helpers.disagree holds them). The transport contract at
a pass's first run: an extra workspace() on one rank, or a pass without begin_pass(),
is an error naming the pass (and the ranks and the first differing call); the check
runs once per layer, shape and pass, never again in steady state."""

import pytest

from helpers import disagree
from helpers.faults import run_ranks

TP, T = 2, 2.0
ENV = {"MEGATRON_OVERLAP_TIMEOUT_S": str(T)}


@pytest.mark.parametrize("what", disagree.WHAT)
def test_ranks_that_disagree_are_diagnosed(what):
    per_rank = run_ranks(disagree.disagree_case, TP, what, env=ENV, timeout=60)
    disagree.check(what, per_rank, T)


def _run(what: str, fn=disagree.disagree_case) -> list[dict]:
    per_rank = run_ranks(fn, TP, *([what] if what else []), env=ENV, timeout=60)
    bad = {r: v for r, v in enumerate(per_rank) if v[0] != "ok"}
    assert not bad, "\n".join(f"rank {r} {s}: {v}" for r, (s, v) in bad.items())
    return [v for _, v in per_rank]


def test_a_workspace_call_on_one_rank_only_is_named_with_the_pass_and_the_call():
    for got in _run("workspace"):
        r = got["result"]
        assert r.startswith(
            "WorkspaceMismatchError: megatron_overlap: layer 'proj (row)' fprop: the TP ranks "
            "made different workspace() calls, so their workspaces do not line up"), got
        # call 1 is begin_pass on both; call 2 is where they part
        assert "call 2: rank 0: workspace((2, 2, 16), torch.float32) at gemm_rs.py:" in r, r
        assert "; rank 1: workspace((3,), torch.float32) at disagree.py:" in r and "(uneven)" in r
        assert got["elapsed"] < T  # found by the exchange, not by a timeout
        assert got["after"]["same_shapes"] and got["after"]["err"] <= 1e-5, got["after"]


def test_a_pass_without_begin_pass_is_named():
    for got in _run("no_begin_pass"):
        assert got["result"].startswith(
            "ContractError: megatron_overlap[torch_p2p]: layer 'proj (row)' fprop: "
            "workspace((2, 2, 16), torch.float32) at gemm_rs.py:"), got
        assert "came before the pass called begin_pass()" in got["result"]
        assert got["after"]["same_shapes"] and got["after"]["err"] <= 1e-5, got["after"]


def test_the_contract_check_runs_once_per_shape_and_pass():
    for got in _run("", disagree.audit_once):
        for kind, calls in got.items():
            first, again, third, new_shape = calls
            assert first["exchanges"] == ["layer agreement (shape and settings)",
                                          "workspace calls (hash)", "workspace calls (hash)"], kind
            assert again["exchanges"] == third["exchanges"] == [], (kind, calls)
            assert new_shape["exchanges"] == first["exchanges"], (kind, calls)
            assert all(c["patched"] == [] and c["err"] <= 1e-5 for c in calls), (kind, calls)



def test_a_pass_that_never_opens_its_transport_pass_is_named():
    """A pass that neither calls begin_pass() nor takes a workspace (so no workspace call
    trips first) is a ContractError at its first run, naming the pass, before any exchange."""
    import pytest

    from megatron_overlap.comm import NullTransport
    from megatron_overlap.comm.transport import ContractError
    from megatron_overlap.layers.agree import PassAudit

    audit = PassAudit("qkv (column)", group=None)  # the group is never reached
    with pytest.raises(ContractError, match=r"layer 'qkv \(column\)' fprop: the pass never "
                                            r"called begin_pass\(\)"):
        audit.run("fprop", NullTransport(2), lambda: None)
    assert audit.todo == {"fprop", "bwd"}  # nothing was checked off


def test_a_new_mode_on_a_replayed_shape_is_audited_eagerly():
    """Same shape, passes already replayed, then gather_output and a frozen weight: each new
    mode's audit runs its passes eagerly (a replay would record no begin_pass: before the
    fix, a ContractError on every rank). The forward's output is unchanged by freezing."""
    from helpers import dist
    from helpers.disagree import new_mode_after_replays

    for calls in dist.run(new_mode_after_replays, 2, timeout=180):
        assert all(c.startswith("ok ") for c in calls[:-1]), calls
        # calls[0] ran the pass (audited), calls[2] was a stand-in replay (writes nothing)
        plain, gathered, frozen = calls[0], calls[3], calls[4]
        assert frozen == plain and gathered != plain, calls  # gathered: every rank's columns
        assert calls[-1] != "replays 0", calls  # the passes were replayed before the new modes
