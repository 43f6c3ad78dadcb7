"""A layer pass captured once in a CUDA graph and replayed, to take its host cost
out of eager training.

An overlapped pass issues tens of small launches (chunk GEMMs, copies, signals,
events, stream switches); on a GPU host each costs microseconds, so issuing a pass
can take longer than its GEMMs run. A replay issues it in one launch.

- What a graph is valid for: the tensors it reads and writes, by address, shape,
  strides and dtype, the transport object and its workspace generation (a
  workspace that grew has moved). Every input and output of the pass is passed in (outputs
  allocated by the caller, so they are ordinary tensors of the caching allocator);
  whatever the pass allocates inside is scratch, from one memory pool that all
  pass graphs of a device share (passes run one after another on the caller's
  stream, and no scratch tensor outlives its pass).
- When: a signature seen `capture_after` times is captured; earlier calls run
  eagerly (the first one also sizes the workspaces). Training allocates the same
  addresses step after step, so steady state replays; a call whose tensors moved
  runs eagerly, exactly as before. (Device tensors a caller keeps from every step move
  them: made after a backward freed what its forward allocated, an FP8 forward's FP8
  input, weight and scales, or the buffer a column backward gathered its input into,
  they take those blocks; tests/test_fp8_replay.py.) At most `max_graphs` per pass are kept (oldest
  dropped first).
- Ranks need not agree on replay versus eager: a replay enqueues the same
  transfers into the same workspace places as the eager pass.
- What does not change: the trace and the per-op stats (recorded at capture,
  re-emitted at each replay), and the watchdog: each replay is watched as one
  wait, and a replay that does not finish is diagnosed with every wait the pass
  makes (rank, pass, chunk, peer), the device-side timeout as backstop.
- Not used inside someone else's capture (the pass is captured there), for a layer
  Megatron graphs itself (`off`: layers.graphs), on CPU,
  or on transports whose transfers keep host-side state (`Transport.replayable`).
  MEGATRON_OVERLAP_GRAPHS=0 (or install(graphs=False)) turns it off.
"""

from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from typing import Callable, Optional, Sequence

import torch

from ..comm import stats, trace
from ..comm.transport import Transport
from . import streams

_tokens = itertools.count()
_pools: dict[int, tuple] = {}  # device index -> (scratch pool, capture stream, keeper graph, its tensor)
_enabled: Optional[bool] = None  # install(graphs=...) sets it; None: the environment's default
# every pass's calls in this process, never decremented (a layer freed keeps its share):
# calls; replays, a launch of a graph captured at an earlier call; captures (that call
# captures, then launches). Forwards count on the main thread, backwards on the autograd
# engine's, which a training step does not run at the same time.
_totals = {"calls": 0, "replays": 0, "captures": 0, "evictions": 0}
log = logging.getLogger("megatron_overlap")


def enabled() -> bool:
    """Whether passes are captured and replayed (MEGATRON_OVERLAP_GRAPHS, default on;
    read once)."""
    global _enabled
    if _enabled is None:
        from ..config.env import graphs

        _enabled = graphs()
    return _enabled


def set_enabled(value: Optional[bool]) -> Optional[bool]:
    """Override the environment's default (None: read it again); returns the previous value."""
    global _enabled
    previous, _enabled = _enabled, value
    return previous


def totals() -> dict[str, int]:
    """Every layer pass's calls in this process so far: `calls`, `replays` (issued as one
    launch of a graph captured at an earlier call) and `captures`; the rest of the calls
    ran eagerly, paying the full host cost. `evictions`: graphs dropped for a pass's
    `max_graphs` bound (a pass cycling through more signatures keeps recapturing).
    Telemetry logs the per-step change."""
    return dict(_totals)


def pool_memory(dev: Optional[int] = None) -> tuple[int, int]:
    """(reserved, allocated) bytes of the device's pass-graph scratch pool: memory the
    process holds for the replays beside the caching allocator's own (a tensor allocated
    in it is also in `torch.cuda.memory_allocated`); (0, 0) before the first capture (and
    on a machine without CUDA)."""
    if not _pools:
        return 0, 0
    dev = torch.cuda.current_device() if dev is None else dev
    if dev not in _pools:
        return 0, 0
    pool = tuple(_pools[dev][0])
    segs = [s for s in torch.cuda.memory_snapshot()
            if s["device"] == dev and tuple(s.get("segment_pool_id", ())) == pool]
    return sum(s["total_size"] for s in segs), sum(s["allocated_size"] for s in segs)


def _pool(dev: int) -> tuple:
    """The device's shared scratch pool of pass graphs and the stream passes are captured
    on. A pool whose graphs are all gone cannot take a new capture (the caching allocator
    asserts), and layers come and go, so a one-node graph captured into it at creation
    keeps it alive. No GEMM runs on the capture stream (`streams.off_capture`)."""
    if dev not in _pools:
        pool, stream, keeper = torch.cuda.graph_pool_handle(), torch.cuda.Stream(), torch.cuda.CUDAGraph()
        flag = torch.zeros(1, device=torch.device("cuda", dev))
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            keeper.capture_begin(pool=pool, capture_error_mode="thread_local")
            flag.add_(1)  # never replayed
            keeper.capture_end()
        _pools[dev] = (pool, stream, keeper, flag)
    return _pools[dev]


def _token(tp: Transport) -> int:
    """This transport object's own number: a graph reads and writes its workspaces, so a
    graph captured on one transport never replays on another (a layer moved to a new one,
    whose generation may well be equal), nor on one allocated where a freed one was."""
    token = tp.__dict__.get("_replay_token")
    if token is None:
        token = tp.__dict__["_replay_token"] = next(_tokens)
    return token


def _signature(tp: Transport, tensors: Sequence[Optional[torch.Tensor]]) -> tuple:
    return (_token(tp), tp.generation) + tuple(
        None if t is None else (t.data_ptr(), t.shape, t.stride(), t.dtype) for t in tensors)


def taken_back(before: dict) -> tuple[tuple[str, int, int], ...]:
    """What the stats counted since the snapshot `before` (a capture's transfers), taken
    back out of them, as ((op, transfers, bytes), ...): the capture moved nothing, each
    replay counts it."""
    counted = []
    for op, s in stats.snapshot(reset=False).items():
        b = before.get(op, {"transfers": 0, "bytes": 0})
        if s["transfers"] > b["transfers"]:
            counted.append((op, s["transfers"] - b["transfers"], s["bytes"] - b["bytes"]))
    stats.forget({op: (t, n) for op, t, n in counted})
    return tuple(counted)


class _Graph:
    # stats: ((op, transfers, bytes), ...) re-counted per replay; waits: what tp.watch_replay reports
    __slots__ = ("graph", "events", "stats", "waits")

    def __init__(self, graph, events, op_stats, waits):
        self.graph, self.events, self.stats, self.waits = graph, events, op_stats, waits


class PassGraphs:
    """The captured graphs of one layer pass (one per signature)."""

    def __init__(self, name: str, max_graphs: int = 8, capture_after: int = 2,
                 off: Optional[str] = None):
        self.name, self.max_graphs, self.capture_after = name, max_graphs, capture_after
        self.off = off or None  # why this pass is never captured here (it runs eagerly)
        self._graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self._seen: OrderedDict[tuple, int] = OrderedDict()
        # calls: every run(); replays: graph launches (a capture's own call included, unlike
        # `totals`); the rest ran eagerly (first sightings, moved tensors, unusable)
        self.calls = self.replays = self.captures = 0
        self.failed: str | None = None  # why a capture failed: the pass then runs eagerly

    def run(self, tp: Transport, body: Callable[[], None],
            tensors: Sequence[Optional[torch.Tensor]], static: tuple = ()) -> None:
        """Run `body` (the whole pass: every tensor it reads or writes is in `tensors`,
        every host-side choice it makes that can change from call to call in `static`)
        eagerly, or as a replay of its graph."""
        self.calls += 1
        _totals["calls"] += 1
        if self.failed is not None or not self._usable(tp, tensors):
            body()
            return
        key = self._key(tp, tensors, static)
        entry = self._graphs.get(key)
        if entry is None:
            if self._sighted(key) < self.capture_after:
                body()
                return
            try:
                entry = self._capture(tp, body)
            except Exception as exc:  # never fail a training step for want of a graph
                self.failed = f"{type(exc).__name__}: {exc}"
                log.warning("megatron_overlap: %s: the pass could not be captured in a CUDA "
                            "graph (%s); it runs eagerly from now on", self.name, self.failed)
                tp.check()  # a transport failure is the caller's error, not a capture's
                body()
                return
            self._graphs[key] = entry
            _totals["captures"] += 1
            while len(self._graphs) > self.max_graphs:
                self._graphs.popitem(last=False)
                _totals["evictions"] += 1
        else:
            self._graphs.move_to_end(key)
            _totals["replays"] += 1
        tp.check()
        entry.graph.replay()
        self.replays += 1
        tp.watch_replay(entry.waits)
        for op, transfers, nbytes in entry.stats:
            stats.started(op, nbytes, transfers)
        if entry.events and trace.active():
            for ev in entry.events:
                trace.record(ev.kind, ev.op, ev.chunk, ev.via)

    def run_eagerly(self, tp: Transport, body: Callable[[], None],
                    tensors: Sequence[Optional[torch.Tensor]], static: tuple = ()) -> None:
        """Run `body` eagerly whatever is captured, counting it as a sighting of its
        signature (a pass whose host-side calls must be seen: `layers.agree`'s audit)."""
        self.calls += 1
        _totals["calls"] += 1
        if self.failed is None and self._usable(tp, tensors):
            key = self._key(tp, tensors, static)
            if key not in self._graphs:
                self._sighted(key, keep=True)
        body()

    def _sighted(self, key: tuple, keep: bool = False) -> int:
        """Count one more sighting of `key` and return the count; it is remembered (oldest
        forgotten first) while under `capture_after`, or with `keep`."""
        seen = self._seen.pop(key, 0) + 1
        if keep or seen < self.capture_after:
            self._seen[key] = seen
            while len(self._seen) > 4 * self.max_graphs:
                self._seen.popitem(last=False)
        return seen

    def _key(self, tp: Transport, tensors, static: tuple) -> tuple:
        """What a graph is valid for (the module docstring's list)."""
        return _signature(tp, tensors) + static

    def _usable(self, tp: Transport, tensors) -> bool:
        return (tp.replayable and enabled() and self.off is None
                and tensors[0] is not None and tensors[0].is_cuda
                and not torch.cuda.is_current_stream_capturing())

    def _capture(self, tp: Transport, body: Callable[[], None]) -> _Graph:
        pool, stream = _pool(torch.cuda.current_device())[:2]
        main = torch.cuda.current_stream()
        graph = torch.cuda.CUDAGraph()
        before = stats.snapshot(reset=False)
        stream.wait_stream(main)  # before the capture: the pass's inputs are ready
        # the GEMMs the pass would run on the capture stream run on chunk stream 0: this
        # thread's cuBLAS workspace there, made now if its chunk GEMMs have not made it,
        # so that none is taken into the pool
        with torch.cuda.stream(streams.stream(torch.cuda.current_device(), 0)):
            torch.cuda.current_blas_handle()
        with trace.recording() as events, tp.recording_waits() as waits, \
                torch.cuda.stream(stream), streams.capturing_on(stream):
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                body()
            finally:
                graph.capture_end()
        main.wait_stream(stream)
        counted = taken_back(before)
        self.captures += 1
        return _Graph(graph, tuple(events), counted, tp.replay_diagnosis(self.name, waits))
