"""Every rank's recorded schedule (`simulate.transport.record`) timed on a `Sim`.

Each rank's events run in program order on its own clocks; what crosses ranks is
matched as the transports match it:

- a GEMM, add or copy runs on the rank's compute stream once everything the rank
  waited on before issuing it has landed (and, eagerly, once the host launched it);
- a send is matched to the peer's receive from this rank in issue order (p2p
  FIFO); the put starts once the data it sends is in place (the GEMM or add that
  wrote it, or its arrival), what its rank waited on before issuing it has landed,
  and both ranks have issued it; it queues on the sender's egress. A wait returns
  when what its handle receives has landed (sent buffers are not reused within a
  pass, so a put's own completion holds nobody);
- a collective starts once every rank has issued it, with its input ready and
  what the rank waited on landed, and holds every rank's links; a wait on it
  returns when it ends.

A put does not wait for GEMMs issued before it that do not write its data (the
model's choice, as before it ran the code: the copy engine starts once its data is
there). symm and torch_p2p order a put after everything its stream has so far, so
with one GEMM stream a ring AG's forward also waits for the GEMM before it: on
those, the model is optimistic by up to a chunk GEMM per step.

A rank stops at a send whose receive is not posted yet, at a collective not every
rank has reached, or at a wait on what has not landed, and runs on once it is
there; each link so takes its owner's puts and collectives in program order, and
the result does not depend on which rank is played first. Ranks that all stop are
a schedule that deadlocks: an error.
"""

from __future__ import annotations

from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable, Sequence

from .timeline import Sim
from .transport import Event, Region


@dataclass(frozen=True)
class Costs:
    """What the recorded work costs on this machine (times in us)."""

    gemm_us: Callable[[int, int, int], float]  # one GEMM of (rows, k, n)
    launch_us: float  # host time to launch one GEMM (eager)
    mem_us: Callable[[float], float]  # a memory-bound kernel moving (reading + writing) bytes
    collective_sms: int | None = None  # SMs a collective's kernels run on (None: NCCL's own)


class _Ready:
    """When each region of one rank was last written."""

    def __init__(self) -> None:
        self._writes: dict[int, list[tuple[int, int, float]]] = defaultdict(list)

    def write(self, region: Region, t: float) -> None:
        self._writes[region[0]].append((region[1], region[2], t))

    def at(self, region: Region) -> float:
        storage, lo, hi = region
        return max((t for a, b, t in self._writes.get(storage, ()) if a < hi and lo < b),
                   default=0.0)


def play(sim: Sim, traces: Sequence[Sequence[Event]], costs: Costs) -> None:
    """Time every rank's events on `sim` (sim.end() is then the pass's end)."""
    _Player(sim, traces, costs).run()


class _Player:
    def __init__(self, sim: Sim, traces: Sequence[Sequence[Event]], costs: Costs):
        self.sim, self.traces, self.costs, world = sim, traces, costs, len(traces)
        self.pos = [0] * world
        self.frontier = [0.0] * world  # what each rank's stream has waited for
        self.ready = [_Ready() for _ in range(world)]
        self.handles: dict[tuple[int, int], list] = {}  # (rank, handle) -> [pending, done at]
        self.posted: dict[tuple[int, int], deque] = defaultdict(deque)  # (src, dst) -> receives
        self.sent: dict[int, int] = {}  # rank -> sends of its current exchange matched so far
        self.colls: dict[int, list] = defaultdict(list)  # n-th collective -> ranks' issues
        self.ncoll = [0] * world
        self.blocked: dict[tuple, list[int]] = defaultdict(list)  # what -> ranks stopped on it
        self.runnable = deque(range(world))
        self.times: dict[tuple, float] = {}  # a schedule repeats a few shapes many times

    def run(self) -> None:
        traces, pos = self.traces, self.pos
        while self.runnable:
            r = self.runnable.popleft()
            events = traces[r]
            while pos[r] < len(events):
                stop = self.step(r, events[pos[r]])
                if stop is not None:
                    self.blocked[stop].append(r)
                    break
                pos[r] += 1
        stuck = "; ".join(f"rank {r} at {traces[r][pos[r]][:2]}" for r in range(len(traces))
                          if pos[r] < len(traces[r]))
        if stuck:
            raise RuntimeError(f"megatron_overlap.simulate: the modelled ranks wait on each "
                               f"other for ever ({stuck}): the schedule deadlocks when sends "
                               f"meet their receives in issue order")

    def wake(self, what: tuple) -> None:
        self.runnable.extend(self.blocked.pop(what, ()))

    def landed(self, rank: int, h: int, t: float) -> None:
        entry = self.handles[(rank, h)]
        entry[0] -= 1
        entry[1] = max(entry[1], t)
        if not entry[0]:
            self.wake(("handle", rank, h))

    # -- one event: None when done, else what the rank waits for -------------------------------
    def step(self, r: int, ev: Event) -> tuple | None:
        kind, sim = ev[0], self.sim
        if kind == "gemm":
            _, rows, k, n, out = ev
            sim.launch(r, self.costs.launch_us)
            self.ready[r].write(out, sim.compute(r, self.gemm_us(rows, k, n), self.frontier[r]))
        elif kind == "add":  # out += another of its size: two reads and a write
            self.ready[r].write(ev[2], sim.compute(r, self.mem_us(3 * ev[1]), self.frontier[r]))
        elif kind == "reduce":  # out = the sum of the slices of `inp`, once all are written
            _, moved, out, inp = ev
            start = max(self.frontier[r], self.ready[r].at(inp))
            self.ready[r].write(out, sim.compute(r, self.mem_us(moved), start))
        elif kind == "copy":
            self.ready[r].write(ev[1], max(self.ready[r].at(ev[2]), self.frontier[r]))
        elif kind == "exchange":
            return self.exchange(r, ev)
        elif kind == "collective":
            return self.collective(r, ev)
        elif kind == "wait":
            pending, at = self.handles[(r, ev[1])]
            if pending:
                return ("handle", r, ev[1])
            self.frontier[r] = max(self.frontier[r], at)
        else:
            raise ValueError(f"simulate.play: unknown event {ev!r}")
        return None

    def exchange(self, r: int, ev: Event) -> tuple | None:
        _, h, sends, recvs = ev
        sim, sent = self.sim, self.sent
        if r not in sent:  # first visit: launch every put, post every receive
            for _ in sends:
                sim.launch_comm(r)
            self.handles[(r, h)] = [len(recvs), 0.0]
            for peer, region in recvs:
                self.posted[(peer, r)].append((sim.host[r], h, region))
                self.wake(("posted", peer, r))
            sent[r] = 0
        while sent[r] < len(sends):
            peer, nbytes, region = sends[sent[r]]
            queue = self.posted[(r, peer)]
            if not queue:
                return ("posted", r, peer)
            host, ph, dst = queue.popleft()
            t = sim.transfer(r, peer, nbytes,
                             max(self.ready[r].at(region), self.frontier[r], sim.host[r], host))
            self.ready[peer].write(dst, t)
            self.landed(peer, ph, t)
            sent[r] += 1
        del sent[r]
        return None

    def collective(self, r: int, ev: Event) -> tuple | None:
        _, h, kind, block, inp, out = ev
        n, sim, costs = self.ncoll[r], self.sim, self.costs
        if (r, h) not in self.handles:  # first visit: launch it, wait for the other ranks
            sim.launch_comm(r)
            self.handles[(r, h)] = [1, 0.0]
            issued = self.colls[n]
            issued.append((r, h, max(self.ready[r].at(inp), self.frontier[r], sim.host[r]), out))
            if len(issued) == len(self.traces):
                end = sim.collective(block, max(i[2] for i in issued), costs.collective_sms)
                if kind == "all_reduce":  # a reduce-scatter, then an all-gather
                    end = sim.collective(block, end, costs.collective_sms)
                for rank, rh, _, dst in issued:
                    self.ready[rank].write(dst, end)
                    self.landed(rank, rh, end)
        if self.handles[(r, h)][0]:
            return ("handle", r, h)
        self.ncoll[r] += 1
        return None

    def gemm_us(self, rows: int, k: int, n: int) -> float:
        key = (rows, k, n)
        if key not in self.times:
            self.times[key] = self.costs.gemm_us(rows, k, n)
        return self.times[key]

    def mem_us(self, moved: int) -> float:
        key = ("mem", moved)
        if key not in self.times:
            self.times[key] = self.costs.mem_us(moved)
        return self.times[key]
