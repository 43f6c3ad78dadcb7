"""Ranks that disagree are diagnosed, not crashed (TP=2, gloo): different token
counts or settings for one layer raise DisagreementError on every rank, naming the
ranks and what differs, before any transfer, and the next agreeing call works; a
rank that runs Megatron's own layer (no install()) leaves the others a bounded
diagnosis that names that possible cause. The transport contract at a pass's first
run: an extra workspace() on one rank, or a pass without begin_pass(), is an error
naming the pass (and the ranks and the first differing call); the check runs once
per layer, shape and pass, never again in steady state."""

from helpers.disagree import audit_once, disagree_case
from helpers.faults import run_ranks

TP, T = 2, 2.0
ENV = {"MEGATRON_OVERLAP_TIMEOUT_S": str(T)}


def _run(what: str, fn=disagree_case) -> list[dict]:
    per_rank = run_ranks(fn, TP, *([what] if what else []), env=ENV, timeout=60)
    bad = {r: v for r, v in enumerate(per_rank) if v[0] != "ok"}
    assert not bad, "\n".join(f"rank {r} {s}: {v}" for r, (s, v) in bad.items())
    return [v for _, v in per_rank]


def test_different_token_counts_are_named_on_every_rank_and_nothing_is_left_behind():
    for got in _run("tokens"):
        assert got["result"] == (
            "DisagreementError: megatron_overlap: layer 'proj (row)': the TP ranks disagree, so "
            "no transfer was started: input shape: rank 0: (4, 2, 12); rank 1: (6, 2, 12). Give "
            "every rank of the TP group the same micro-batch shapes and the same install() "
            "settings."), got
        assert got["elapsed"] < T  # found by the exchange, not by a timeout
        assert got["after"]["same_shapes"] and got["after"]["err"] <= 1e-5, got["after"]


def test_different_settings_are_named_on_every_rank():
    for got in _run("settings"):
        assert got["result"].startswith("DisagreementError: megatron_overlap: layer 'proj (row)': "
                                        "the TP ranks disagree"), got
        assert ("proj_fprop: rank 0: 'method=pipeline num_splits=2 aggregate=0 ring_order=auto'; "
                "rank 1: 'method=pipeline num_splits=4 aggregate=0 ring_order=auto'") in got["result"]
        assert "input shape" not in got["result"]
        assert got["elapsed"] < T


def test_a_rank_without_install_is_a_bounded_diagnosis_naming_that_cause():
    survivor, plain = _run("no_install")
    assert plain["result"] == "no error"  # Megatron's own column forward moves nothing
    assert survivor["result"].startswith(
        "CommError: megatron_overlap: rank 0/2 waited for 'layer agreement (shape and settings)' "
        "chunk 0 (from all ranks) 2s and group ranks 1 (global 1) never arrived"), survivor
    assert "a rank without install()" in survivor["result"]
    assert T * 0.9 <= survivor["elapsed"] <= T + 4


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
    for got in _run("", audit_once):
        for kind, calls in got.items():
            first, again, third, new_shape = calls
            assert first["exchanges"] == ["layer agreement (shape and settings)",
                                          "workspace calls (hash)", "workspace calls (hash)"], kind
            assert again["exchanges"] == third["exchanges"] == [], (kind, calls)
            assert new_shape["exchanges"] == first["exchanges"], (kind, calls)
            assert all(c["patched"] == [] and c["err"] <= 1e-5 for c in calls), (kind, calls)

