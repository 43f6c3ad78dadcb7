"""Ranks that disagree are diagnosed, not crashed (TP=2, gloo): different token
counts or settings for one layer raise DisagreementError on every rank, naming the
ranks and what differs, before any transfer, and the next agreeing call works; a
rank that runs Megatron's own layer (no install()) leaves the others a bounded
diagnosis that names that possible cause."""

from helpers.disagree import disagree_case
from helpers.faults import run_ranks

TP, T = 2, 2.0
ENV = {"MEGATRON_OVERLAP_TIMEOUT_S": str(T)}


def _run(what: str) -> list[dict]:
    per_rank = run_ranks(disagree_case, TP, what, env=ENV, timeout=60)
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
