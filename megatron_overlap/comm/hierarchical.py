"""`hierarchical`: one transport per peer, behind the one contract.

A TP group that spans nodes (or NVLink / P2P domains) moves bytes two ways: peers
in this rank's domain through an intra-domain transport (`symm` on GPUs,
`torch_p2p` over a domain-local process group otherwise), the others through an
inter-node transport over the whole TP group (`torch_p2p`: NCCL on GPUs, gloo on
CPU; or `nvshmem`, through `inter_backend`). Every `exchange` is split by peer;
bulk collectives go through the inter transport. Each transfer is traced
with the transport that carried it (`intra:<backend>` / `inter:<backend>`), so
tests and telemetry can tell the links apart.

The intra transport runs on its own process group (its own NCCL communicator or
gloo pairs), so intra-domain ring steps never queue behind inter-node transfers.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from ..config.backends import INTER_BACKENDS
from .topology import Topology
from .torch_p2p import TorchP2PTransport
from .transport import Handle, Peer, SendRecv, Transport

# Domain-local groups live as long as the default group: torch names a group created
# with use_local_synchronization by its ranks, so creating it twice is an error.
_subgroups: dict[tuple[object, tuple[int, ...]], dist.ProcessGroup] = {}


def _groups_held() -> int | None:
    """How many process groups this rank belongs to (torch's count; None if unknown)."""
    try:
        return len(dist.distributed_c10d._world.pg_names)
    except AttributeError:
        return None


def domain_group(global_ranks: Sequence[int]) -> dist.ProcessGroup:
    """A process group of one domain's ranks; only its members call this (all of them)."""
    key = (dist.group.WORLD, tuple(sorted(global_ranks)))
    if key not in _subgroups:
        from .transport import default_timeout  # bounds the group's creation barrier

        _subgroups[key] = dist.new_group(list(key[1]), use_local_synchronization=True,
                                         timeout=default_timeout())
    return _subgroups[key]


def _check_groups_held(group: dist.ProcessGroup, topo: Topology) -> None:
    """torch names a group made with use_local_synchronization from its ranks and how many
    groups each member already belongs to; members that differ would wait for each other
    forever under different names. Collective over `group`: say so instead of hanging."""
    from .exchange import all_gather_object

    held = all_gather_object(_groups_held(), group, "process-group count check")
    mine = topo.domains[topo.domain[topo.rank]]
    if None not in held and len({held[p] for p in mine}) > 1:
        counts = ", ".join(f"rank {dist.get_global_rank(group, p)}: {held[p]}" for p in mine)
        raise RuntimeError(
            f"megatron_overlap: the ranks of one node belong to different numbers of process "
            f"groups ({counts}), so torch cannot name their node-local group alike. Create "
            f"process groups on every rank alike (Megatron's parallel_state does), or pick "
            f"backend='torch_p2p' (one transport, no node-local group).")


class _All(Handle):
    def __init__(self, handles: Sequence[Handle]):
        self._handles = list(handles)

    def wait(self) -> None:
        for h in self._handles:
            h.wait()


def _shares_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors' spans of memory intersect (views of one buffer may)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((d - 1) * st for d, st in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


class PerPeerTransport(Transport):
    """Routes each peer to the transport its place in the topology calls for.

    intra: a transport reaching this rank's domain, whose rank i is group rank
    `intra_peers[i]` (None when the domain is this rank alone). inter: a transport
    over the whole TP group (it may also serve as `intra`, with group ranks)."""

    name = "hierarchical"

    def __init__(self, topo: Topology, intra: Transport | None, intra_peers: Sequence[int],
                 inter: Transport):
        super().__init__(topo.rank, topo.world_size, inter.timeout)
        self.topology, self.intra, self.inter = topo, intra, inter
        # this pass's arrivals: (role, the exchange's handle, its receive buffers)
        self._received: list[tuple[str, Handle, list[torch.Tensor]]] = []
        domain = set(topo.domains[topo.domain[topo.rank]]) if intra is not None else set()
        # peer -> (role, transport, the peer's rank in that transport)
        local = {p: i for i, p in enumerate(intra_peers)}
        self._route = {p: ("intra", intra, local[p]) if p in domain else ("inter", inter, p)
                       for p in range(self.world_size)}
        self._labels = {"intra": f"intra:{intra.name}" if intra is not None else "",
                        "inter": f"inter:{inter.name}"}

    # -- who carries what --------------------------------------------------------------------
    def transport_for_peer(self, peer: Peer) -> Transport:
        return self._route[peer][1]

    def via_for_peer(self, peer: Peer) -> str:
        return self._labels[self._route[peer][0]]

    def via(self, peers) -> str:
        if isinstance(peers, str):  # a collective over the group
            return self._labels["inter"]
        to, frm = peers
        return "+".join(sorted({self.via_for_peer(p) for p in (*to, *frm)})) or self._labels["inter"]

    @property
    def backends(self) -> tuple[str, ...]:
        parts = ([self.intra.name] if self.intra is not None else []) + [self.inter.name]
        return tuple(dict.fromkeys(parts))

    def _parts(self) -> list[Transport]:
        return [t for t in dict.fromkeys([self.intra, self.inter]) if t is not None]

    def peer_map(self) -> dict[Peer, str]:
        """{group rank: transport label} for every peer of this rank."""
        return {p: self.via_for_peer(p) for p in range(self.world_size) if p != self.rank}

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {**super().describe(), "topology": self.topology.describe(),
                                  "inter": self.inter.describe(), "peers": self.peer_map()}
        if self.intra is not None:
            out["intra"] = self.intra.describe()
        return out

    # -- contract extras ---------------------------------------------------------------------
    def workspace(self, shape, dtype, device=None) -> torch.Tensor:
        # Receive buffers must suit the intra transport (symmetric memory for symm);
        # torch_p2p writes into any tensor. An inter transport with its own symmetric
        # heap (nvshmem) also serves the domain, so its workspace is the one (`build`).
        return (self.intra or self.inter).workspace(shape, dtype, device)

    def begin_pass(self, name: str = "", comm_priority: int = 0) -> None:
        self.check()
        self._received = []
        for t in self._parts():
            t.begin_pass(name, comm_priority)

    def check(self) -> None:
        for t in self._parts():
            t.check()

    # -- the four transfers ------------------------------------------------------------------
    def _start_exchange(self, sends, recvs: Sequence[SendRecv], op: str, chunk: int) -> Handle:
        parts: dict[str, tuple[Transport, list, list]] = {}
        for t, p, dst in sends:
            role, tp, local = self._route[p]
            parts.setdefault(role, (tp, [], []))[1].append((t, local, dst))
        for t, p in recvs:
            role, tp, local = self._route[p]
            parts.setdefault(role, (tp, [], []))[2].append((t, local))
        # A send may forward what the previous exchange received (a ring all-gather's step).
        # Each transport orders its own exchanges, not the other's: where this one sends
        # through one transport bytes that arrived through the other, the current stream
        # (whose order the sending transport follows) waits for that arrival first, however
        # many exchanges ago in this pass it came. A send of other bytes (a reduce-scatter's
        # partial) waits for nothing.
        for role, (_, s, _) in parts.items():
            for other, h, into in self._received:
                if other != role and any(_shares_bytes(t, r) for t, _, _ in s for r in into):
                    h.wait()
        handles = {role: tp.start_untraced("exchange", s, r, op, chunk)
                   for role, (tp, s, r) in parts.items()}
        self._received += [(role, h, [t for t, _ in parts[role][2]])
                           for role, h in handles.items() if parts[role][2]]
        out = list(handles.values())
        return out[0] if len(out) == 1 else _All(out)

    def _start_all_gather(self, out, inp, op, chunk) -> Handle:
        return self.inter.start_untraced("all_gather", out, inp, op, chunk)

    def _start_reduce_scatter(self, out, inp, op, chunk) -> Handle:
        return self.inter.start_untraced("reduce_scatter", out, inp, op, chunk)

    def _start_all_reduce(self, tensor, op, chunk) -> Handle:
        return self.inter.start_untraced("all_reduce", tensor, op, chunk)


def build(group: dist.ProcessGroup, topo: Topology, device: torch.device | None,
          inter_backend: str = "torch_p2p") -> PerPeerTransport:
    """The per-peer transport of `group` (every rank of it calls this at once): symm
    inside a GPU domain where device is CUDA, torch_p2p inside it otherwise;
    `inter_backend` across domains. nvshmem reaches every peer through one symmetric
    heap (NVLink inside a node, the NIC across), so it serves the domain too."""
    if inter_backend not in INTER_BACKENDS:
        raise ValueError(f"megatron_overlap: inter-node backend '{inter_backend}' is not one of "
                         f"{INTER_BACKENDS}; set MEGATRON_OVERLAP_INTER_BACKEND to one of them")
    if inter_backend == "nvshmem":  # its own transport (comm/nvshmem.py), one heap for all
        from .nvshmem import NvshmemTransport
        shared = NvshmemTransport(group, device)
        return PerPeerTransport(topo, shared, range(topo.world_size), shared)
    mine = topo.domains[topo.domain[topo.rank]]
    intra: Transport | None = None
    _check_groups_held(group, topo)
    if len(mine) > 1:
        sub = domain_group([dist.get_global_rank(group, p) for p in mine])
        if device is not None and device.type == "cuda":
            from .symm import SymmTransport
            intra = SymmTransport(sub, device)
        else:
            intra = TorchP2PTransport(sub)
        # the subgroup orders its ranks by global rank; map group ranks onto that order
        order = sorted(mine, key=lambda p: dist.get_global_rank(group, p))
        mine = tuple(order)
    return PerPeerTransport(topo, intra, mine, TorchP2PTransport(group))
