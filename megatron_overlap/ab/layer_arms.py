"""The arms of a per-layer benchmark: one TP layer's forward (AG->GEMM or GEMM->RS)
done every way we compare, on the same inputs.

- `baseline`: Megatron's non-overlapped order: all_gather_into_tensor then one
  GEMM, or one GEMM then reduce_scatter_tensor, on the default process group.
- `gemm`: that one GEMM alone: the baseline's compute-only floor.
- `<backend>/<method>`: our schedule on a transport (`transport_for`).
- `floor/<method>`: the same schedule on the null transport: its compute-only floor.
- `torch_async_tp`: torch's fused ops (floor: `gemm`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from .. import comm
from ..overlap.pass_fn import pass_fn
from ..overlap.streams import ChunkStreams
from . import async_tp
from ..comm import NullTransport
from .shapes import Shape


@dataclass(frozen=True)
class Method:
    """A schedule and its knobs, written `ring_exchange`, `ring_exchange+agg`,
    `pipeline:4`, `bulk`, optionally with `/2s` (chunk GEMMs on 2 streams). `bulk` here
    is the schedules' bulk: the whole transfer, then the GEMM, no overlap (the pass's
    plain order on our transport); ub_cfgs' `bulk` of a backward pass hides it under
    another GEMM, which one pass alone cannot show."""

    method: str
    splits: int = 0  # pipeline chunks (0: the schedule's own: TP blocks)
    aggregate: bool = False
    streams: int = 1

    @property
    def label(self) -> str:
        s = self.method + ("+agg" if self.aggregate else "") + (f":{self.splits}" if self.splits else "")
        return s + (f"/{self.streams}s" if self.streams > 1 else "")

    def applies(self, op: str, tp: int, rows: int) -> str | None:
        """None if this method runs on an `op` layer at this TP, else why not ("n/a":
        not a schedule of that kind of layer)."""
        ok = {"ag": ("ring_exchange", "bulk"), "rs": ("pipeline", "ring_exchange", "bulk")}[op]
        if self.method not in ok or (self.aggregate and op != "ag"):
            return "n/a"
        if self.aggregate and tp <= 2:
            return "aggregate changes nothing at TP <= 2"
        if self.aggregate and tp % 2:
            return f"aggregate pairs ranks: TP {tp} is odd"
        if self.method == "pipeline" and rows % max(self.splits, 1):
            return f"{rows} rows per rank do not split into {self.splits} chunks"
        return None


def parse_methods(spec: str) -> list[Method]:
    out = []
    for item in spec.split(","):
        item = item.strip()
        body, _, streams = item.partition("/")
        name, _, splits = body.partition(":")
        agg = name.endswith("+agg")
        name = name.removesuffix("+agg")
        if name not in ("ring_exchange", "pipeline", "bulk"):
            raise SystemExit(f"unknown method {item!r}: ring_exchange[+agg] | pipeline:N | bulk, "
                             f"each optionally /Ns (GEMM streams)")
        if name == "pipeline" and not splits:
            splits = "4"  # TE's default num_splits
        out.append(Method(name, int(splits or 0), agg, int(streams.removesuffix("s") or 1)))
    return out


@dataclass
class Arm:
    name: str
    kind: str  # baseline | gemm | overlap | floor | torch_async_tp
    fn: Callable[[], torch.Tensor]
    check: bool  # compared with the baseline's output before timing
    floor: str | None  # the arm whose time is this arm's compute-only floor
    backend: str | None = None
    method: str | None = None
    info: dict = field(default_factory=dict)


def inputs(shape: Shape, tp: int, rank: int, dtype: torch.dtype, device: torch.device, seed: int = 0
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's x (AG: its [M/tp, K] block; RS: its [M, K] partial input) and its
    [N, K] weight, O(1) outputs, different on every rank."""
    g = torch.Generator(device=device).manual_seed(seed * 1000 + rank)
    rows = shape.m // tp if shape.op == "ag" else shape.m
    x = torch.randn(rows, shape.k, generator=g, device=device).to(dtype)
    w = (torch.randn(shape.n, shape.k, generator=g, device=device) / shape.k ** 0.5).to(dtype)
    return x, w


def baseline_arms(shape: Shape, x: torch.Tensor, w: torch.Tensor, group: dist.ProcessGroup
                  ) -> list[Arm]:
    """Megatron's order (Megatron's `gather_along_first_dim` / `reduce_scatter_along_first_dim`
    are these collectives) and its GEMM alone."""
    tp, wt = dist.get_world_size(group), w.t()
    if shape.op == "ag":
        full = torch.empty(tp * x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)
        resident = torch.randn_like(full, dtype=torch.float32).to(x.dtype)

        def baseline() -> torch.Tensor:
            dist.all_gather_into_tensor(full, x, group=group)
            return torch.matmul(full, wt)

        gemm = lambda: torch.matmul(resident, wt)  # noqa: E731
    else:
        def baseline() -> torch.Tensor:
            y = torch.matmul(x, wt)
            out = y.new_empty(y.shape[0] // tp, y.shape[1])
            dist.reduce_scatter_tensor(out, y, group=group)
            return out

        gemm = lambda: torch.matmul(x, wt)  # noqa: E731
    return [Arm("baseline", "baseline", baseline, False, "gemm"),
            Arm("gemm", "gemm", gemm, False, None)]


RING_METHODS = {"ag": ("ring_exchange",), "rs": ("pipeline", "ring_exchange")}  # take a ring order


def ring_layout(tp: comm.Transport):
    """The ranks per node when `tp` spans nodes (the hierarchical ring order, as a
    layer's `ring_order: auto` picks it), else None (the flat ring)."""
    from ..overlap.hierarchical import choose

    return choose("auto", getattr(tp, "topology", None)).nodes


def schedule_fn(shape: Shape, x: torch.Tensor, w: torch.Tensor, tp: comm.Transport, m: Method,
                nodes=None) -> Callable[[], torch.Tensor]:
    """One layer pass, as a layer runs it (`overlap.pass_fn`), in the hierarchical order
    over `nodes` (the ranks per node) when given."""
    splits = m.splits or tp.world_size
    return pass_fn(x, w, tp, shape.op, m.method, splits, name=f"{shape.name}:{m.label}",
                   streams=ChunkStreams(n=m.streams), aggregate=m.aggregate, nodes=nodes)


def overlap_arms(shape: Shape, x: torch.Tensor, w: torch.Tensor, group: dist.ProcessGroup,
                 backends: list[str], methods: list[Method], skipped: dict[str, str]) -> list[Arm]:
    """<backend>/<method> for every method that applies, each after its compute-only
    floor (the same schedule on the null transport: floor/<method>, with @NxL when it
    runs the hierarchical order over N nodes of L ranks); what does not apply goes to
    `skipped` with the reason."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    rows = shape.m // world
    arms, floors = [], set()
    for m in methods:
        why = m.applies(shape.op, world, rows)
        if why:
            if why != "n/a":
                skipped[m.label] = why
            continue
        for b in backends:
            tp = comm.transport_for(group, b, x.device)
            nodes = ring_layout(tp) if m.method in RING_METHODS[shape.op] else None
            if nodes and m.aggregate:
                skipped[f"{b}/{m.label}"] = ("the hierarchical order runs its own two-level ring; "
                                             "aggregate does not apply")
                continue
            floor = f"floor/{m.label}" + (f"@{len(nodes)}x{len(nodes[0])}" if nodes else "")
            if floor not in floors:
                floors.add(floor)
                arms.append(Arm(floor, "floor", schedule_fn(shape, x, w, NullTransport(world, rank, seed=7),
                                                            m, nodes), False, None, "null", m.label))
            info = {**tp.describe(),
                    **({"ring_order": f"hierarchical {len(nodes)}x{len(nodes[0])}"} if nodes else {})}
            arms.append(Arm(f"{b}/{m.label}", "overlap", schedule_fn(shape, x, w, tp, m, nodes), True,
                            floor, b, m.label, info))
    return arms


def torch_arm(shape: Shape, x: torch.Tensor, w: torch.Tensor, group: dist.ProcessGroup) -> Arm:
    name = async_tp.enable(group)
    if shape.op == "ag":
        fn = lambda: async_tp.all_gather_matmul(x, w, name)  # noqa: E731
    else:
        fn = lambda: async_tp.matmul_reduce_scatter(x, w, name)  # noqa: E731
    return Arm("torch_async_tp", "torch_async_tp", fn, True, "gemm", "torch_symm_mem")
