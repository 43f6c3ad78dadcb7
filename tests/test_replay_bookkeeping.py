"""The bookkeeping of whole-pass replay (`overlap.replay`), on CPU: when a pass is
captured, replayed or run eagerly, what each replay re-emits, and when a graph is
stale. The graphs themselves run on the GPU (tests/gpu/test_replay.py): here a
stand-in records what a capture would have captured and replays nothing."""

from __future__ import annotations

import torch

from megatron_overlap.comm import NullTransport, stats, trace
from megatron_overlap.overlap import replay


class _Graph:
    def __init__(self):
        self.replays = 0

    def replay(self):
        self.replays += 1


class _Recorded(replay.PassGraphs):
    """Captures run the body once (to record what it issues) under a stand-in graph."""

    def _usable(self, tp, tensors):
        return replay.enabled()

    def _capture(self, tp, body):
        before = stats.snapshot(reset=False)
        with trace.recording() as events:
            body()
        self.captures += 1
        return replay._Graph(_Graph(), tuple(events), replay.taken_back(before), "diagnosis")


class _Growing(NullTransport):
    gen = 0

    @property
    def generation(self):
        return self.gen


def _pass(tp, x, out, calls):
    def body():
        calls.append(1)
        tp.begin_pass("qkv_fprop")
        tp.all_gather(out, x, op="qkv_fprop").wait()
    return body


def test_second_sighting_captures_then_replays_and_re_emits_trace_and_stats():
    tp, x, out, calls = NullTransport(2), torch.ones(2, 3), torch.empty(4, 3), []
    graphs = _Recorded("qkv fprop")
    stats.snapshot(reset=True)
    before = replay.totals()
    with trace.recording() as events:
        for _ in range(4):
            graphs.run(tp, _pass(tp, x, out, calls), (x, out))
    assert len(calls) == 2  # first sighting eager, second captured; then replays only
    assert (graphs.calls, graphs.captures, graphs.replays) == (4, 1, 3)  # launches: the capture's too
    # the process's totals (telemetry's source): replays are launches of a graph captured at
    # an earlier call, so the capturing call is not one; they outlive the pass's graphs
    del graphs
    after = replay.totals()
    assert {k: after[k] - before[k] for k in after} == {"calls": 4, "replays": 2, "captures": 1,
                                                         "evictions": 0}
    # every call, eager or replayed, is in the trace and the stats once
    assert [e.kind for e in events] == ["start", "wait"] * 4
    assert stats.snapshot()["qkv_fprop"]["transfers"] == 4


def test_moved_tensors_run_eagerly_and_a_new_generation_recaptures():
    tp, calls = _Growing(2), []
    graphs = _Recorded("proj fprop")
    x, out = torch.ones(2, 3), torch.empty(4, 3)
    for _ in range(3):
        graphs.run(tp, _pass(tp, x, out, calls), (x, out))
    assert (graphs.captures, graphs.replays) == (1, 2)
    moved = torch.empty(4, 3)  # another output address: another signature, eager first
    graphs.run(tp, _pass(tp, x, moved, calls), (x, moved))
    assert (graphs.captures, graphs.replays) == (1, 2)
    tp.gen = 1  # workspaces grew: every graph of the old generation is stale
    graphs.run(tp, _pass(tp, x, out, calls), (x, out))
    graphs.run(tp, _pass(tp, x, out, calls), (x, out))
    assert (graphs.captures, graphs.replays) == (2, 3)


def test_graphs_per_pass_are_bounded_oldest_dropped():
    tp, calls = NullTransport(2), []
    graphs = _Recorded("fc1 fprop", max_graphs=2)
    x = torch.ones(2, 3)
    outs = [torch.empty(4, 3) for _ in range(3)]
    for out in outs:
        for _ in range(2):
            graphs.run(tp, _pass(tp, x, out, calls), (x, out))
    assert graphs.captures == 3 and len(graphs._graphs) == 2
    graphs.run(tp, _pass(tp, x, outs[0], calls), (x, outs[0]))  # dropped: eager again
    assert graphs.replays == 3


def test_disabled_and_cpu_run_the_pass_eagerly():
    tp, x, out, calls = NullTransport(2), torch.ones(2, 3), torch.empty(4, 3), []
    plain = replay.PassGraphs("qkv fprop")  # CPU tensors: never captured
    for _ in range(3):
        plain.run(tp, _pass(tp, x, out, calls), (x, out))
    assert len(calls) == 3 and plain.captures == plain.replays == 0
    previous = replay.set_enabled(False)
    try:
        graphs = _Recorded("qkv fprop")
        for _ in range(3):
            graphs.run(tp, _pass(tp, x, out, calls), (x, out))
        assert graphs.captures == graphs.replays == 0 and len(calls) == 6
    finally:
        replay.set_enabled(previous)
    # nothing captured, so no scratch pool: its size reads as none, without touching CUDA
    # (which a CPU build cannot: the benchmarks' memory accounts read it on any machine)
    assert replay.pool_memory() == (0, 0)


def test_a_pass_that_cannot_be_captured_runs_eagerly_from_then_on(caplog):
    class _Refuses(_Recorded):
        attempts = 0

        def _capture(self, tp, body):
            type(self).attempts += 1
            raise RuntimeError("operation not permitted when stream is capturing")

    tp, x, out, calls = NullTransport(2), torch.ones(2, 3), torch.empty(4, 3), []
    graphs = _Refuses("qkv fprop")
    with caplog.at_level("WARNING", logger="megatron_overlap"):
        for _ in range(5):
            graphs.run(tp, _pass(tp, x, out, calls), (x, out))
    assert len(calls) == 5 and graphs.replays == 0  # every call ran, eagerly
    assert _Refuses.attempts == 1  # one failed capture, never tried again
    assert "not permitted" in graphs.failed
    assert "qkv fprop: the pass could not be captured" in caplog.text


def test_the_contract_check_rides_the_first_eager_run_never_a_capture_or_replay(tmp_path):
    """A pass's first run is audited (its calls recorded, compared over a one-rank group);
    the capture at the second sighting and the replays after carry no recording."""
    import pytest
    import torch.distributed as dist

    from megatron_overlap.comm import ContractError
    from megatron_overlap.layers import agree, functions

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        tp, x, out, calls = NullTransport(2), torch.randn(2, 3), torch.empty(4, 3), []
        tp.begin_pass("sizing")  # the workspace allocated: its growth would be a new generation
        tp.workspace((4, 3), x.dtype, x.device)
        seen: list[list] = []

        def body():
            calls.append(1)
            tp.begin_pass("qkv_fprop")
            seen.append("recording" if "workspace" in vars(tp) else "plain")
            tp.workspace((4, 3), x.dtype, x.device)
        graphs, audit = {"fprop": _Recorded("qkv fprop")}, agree.PassAudit("qkv", None)
        for _ in range(3):
            functions._run(graphs, "fprop", tp, body, x, out, audit=audit)
        assert calls == [1, 1] and graphs["fprop"].captures == 1 and graphs["fprop"].replays == 2
        assert seen == ["recording", "plain"] and audit.todo == {"bwd"}
        assert "workspace" not in vars(tp) and "begin_pass" not in vars(tp)

        def unopened():
            tp.workspace((4, 3), x.dtype, x.device)
        with pytest.raises(ContractError, match=r"layer 'qkv' bwd: workspace\(\(4, 3\), "
                                                r"torch.float32\) at test_replay_bookkeeping.py"):
            functions._run({"bwd": _Recorded("qkv bwd")}, "bwd", tp, unopened, x, out,
                           audit=audit)
        assert audit.todo == {"bwd"} and "workspace" not in vars(tp)
    finally:
        dist.destroy_process_group()
