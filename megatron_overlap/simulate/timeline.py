"""A small in-order event model of one layer pass on every rank of the TP group.

Each GPU has one compute stream; each rank has an egress per link kind (NVLink,
InfiniBand); a task starts when its inputs are ready, its
resources are free (in submission order, like CUDA streams) and, in eager mode,
when the host has launched it. Transfers between two ranks of one node use
NVLink, others InfiniBand. Ranks are simulated individually because a flat ring
across nodes is not symmetric: the ranks behind the IB hop wait on it.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

from .hardware import Hardware, Layout


@dataclass(frozen=True)
class Engine:
    """What moves a pass's intra-node bytes: copy engines or SM kernels on `sms` SMs (their
    copy bandwidth). `held`: SMs the GEMM goes without while the pass runs (the comm
    kernels', or an SM margin). `free`: the compute-only floor, nothing moves."""

    kind: str = "ce"  # ce | sm
    sms: int = 0
    held: int = 0
    free: bool = False


class Sim:
    def __init__(self, hw: Hardware, layout: Layout, engine: Engine) -> None:
        self.hw, self.layout, self.engine = hw, layout, engine
        self.free: dict[tuple, float] = defaultdict(float)
        self.host = [0.0] * layout.tp
        self.transfers = 0
        self.last = 0.0  # the latest completion seen

    # -- what the GEMM gets ---------------------------------------------------------------
    @property
    def gemm_sms(self) -> int | None:
        """SMs left to the GEMM while this pass's communication runs (None: all)."""
        if self.engine.free or self.engine.held <= 0:
            return None
        return max(self.hw.sms - self.engine.held, 1)

    # -- host -------------------------------------------------------------------------------
    def launch(self, rank: int, us: float) -> float:
        """Host time to launch something eagerly on `rank` (nothing under a CUDA graph)."""
        if self.layout.mode == "eager":
            self.host[rank] += us
        return self.host[rank]

    @property
    def comm_launch_us(self) -> float:
        """Host time to launch a transfer or collective; free on the compute-only floor,
        whose measured step cost (the null transport's) already holds the schedule's calls."""
        return 0.0 if self.engine.free else self.hw.eager_comm_us

    def launch_comm(self, rank: int) -> float:
        return self.launch(rank, self.comm_launch_us)

    # -- device -----------------------------------------------------------------------------
    def run(self, resources: Iterable[tuple], duration: float, after: float = 0.0,
            latency: float = 0.0) -> float:
        """Occupy `resources` for `duration` from the earliest time they are all free and
        `after` has passed; done `latency` later (latency does not hold the resources, so
        transfers queued on one link pipeline their latencies)."""
        resources = list(resources)
        start = max([after] + [self.free[r] for r in resources])
        for r in resources:
            self.free[r] = start + duration
        self.last = max(self.last, start + duration + latency)
        return start + duration + latency

    def compute(self, rank: int, duration: float, after: float = 0.0) -> float:
        return self.run([("gpu", rank)], duration, max(after, self.host[rank]))

    def link(self, src: int, dst: int) -> str:
        return "nvlink" if self.layout.node(src) == self.layout.node(dst) else "ib"

    def link_cost(self, link: str, nbytes: float) -> tuple[float, float]:
        """(time the link is busy, latency) of one transfer of nbytes."""
        if self.engine.free or nbytes <= 0:
            return 0.0, 0.0
        if link == "ib":  # the NIC moves it: no SMs, whatever the intra-node engine
            return nbytes / (self.hw.ib_gbs * 1e3), self.hw.ib_latency_us
        bw = self.hw.nvlink_gbs
        if self.engine.kind == "sm":
            bw = min(bw, self.engine.sms * self.hw.sm_copy_gbs)
        return nbytes / (bw * 1e3), self.hw.nvlink_latency_us

    def transfer(self, src: int, dst: int, nbytes: float, after: float = 0.0) -> float:
        """A put from src to dst, from `after` (its data is ready and both ranks have
        issued it: a p2p rendezvous). It holds the sender's egress: puts a rank issues
        share its link one after the other. Ingress is not modelled apart: in these
        schedules every rank receives, per link and at the same time, as many bytes as it
        sends, so egress is the bound."""
        link = self.link(src, dst)
        self.transfers += 1
        busy, latency = self.link_cost(link, nbytes)
        return self.run([("out", link, src)], busy, after, latency)

    def collective_us(self, block_bytes: float, sms: int | None = None) -> float:
        """A ring all-gather / reduce-scatter of one `block_bytes` block per rank, as NCCL
        runs it: intra-node at NVLink speed; across nodes one ring per NIC, so the bus
        bandwidth is min(NVLink, IB x GPUs per node). `sms` caps an SM-driven copy."""
        tp = self.layout.tp
        if tp == 1 or self.engine.free or block_bytes <= 0:
            return 0.0
        hw = self.hw
        if self.layout.nodes == 1:
            bw, lat = hw.nvlink_gbs, hw.nccl_latency_us
        else:
            bw = hw.nccl_inter_gbs or min(hw.nvlink_gbs, hw.ib_gbs * self.layout.local)
            lat = hw.nccl_latency_us + hw.ib_latency_us
        if sms:
            bw = min(bw, sms * hw.sm_copy_gbs)
        return lat + (tp - 1) * block_bytes / (bw * 1e3)

    def collective(self, block_bytes: float, after: float = 0.0, sms: int | None = None) -> float:
        """A collective over the whole group, from `after` (every rank has issued it and
        its input is ready): every rank's links are busy for its duration."""
        links = ("nvlink",) if self.layout.nodes == 1 else ("nvlink", "ib")
        res = [("out", link, r) for r in range(self.layout.tp) for link in links]
        self.transfers += 1
        return self.run(res, self.collective_us(block_bytes, sms), after)

    def end(self) -> float:
        """When the last thing of the pass finishes, on any rank."""
        return max([self.last, *self.free.values()])
