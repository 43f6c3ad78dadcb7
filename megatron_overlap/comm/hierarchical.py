"""`hierarchical`: one transport per peer, behind the one contract.

A TP group that spans nodes (or NVLink / P2P domains) moves bytes two ways: peers
in this rank's domain through an intra-domain transport (`symm` on GPUs,
`torch_p2p` over a domain-local process group otherwise), the others through an
inter-node transport over the whole TP group (`torch_p2p`: NCCL on GPUs, gloo on
CPU; `nvshmem` slots in through `inter_backend`). Every `exchange` is split by
peer; bulk collectives go through the inter transport. Each transfer is traced
with the transport that carried it (`intra:<backend>` / `inter:<backend>`), so
tests and telemetry can tell the links apart.

The intra transport runs on its own process group (its own NCCL communicator or
gloo pairs), so intra-domain ring steps never queue behind inter-node transfers.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from .topology import Topology
from .torch_p2p import TorchP2PTransport
from .transport import Handle, Peer, SendRecv, Transport

INTER_BACKENDS = ("torch_p2p", "nvshmem")
# Domain-local groups live as long as the default group: torch names a group created
# with use_local_synchronization by its ranks, so creating it twice is an error.
_subgroups: dict[tuple[object, tuple[int, ...]], dist.ProcessGroup] = {}


def domain_group(global_ranks: Sequence[int]) -> dist.ProcessGroup:
    """A process group of one domain's ranks; only its members call this (all of them)."""
    key = (dist.group.WORLD, tuple(sorted(global_ranks)))
    if key not in _subgroups:
        _subgroups[key] = dist.new_group(list(key[1]), use_local_synchronization=True)
    return _subgroups[key]


class _All(Handle):
    def __init__(self, handles: Sequence[Handle]):
        self._handles = list(handles)

    def wait(self) -> None:
        for h in self._handles:
            h.wait()


class PerPeerTransport(Transport):
    """Routes each peer to the transport its place in the topology calls for.

    intra: a transport over this rank's domain (its ranks in `intra_peers` order,
    group ranks), or None when the domain is this rank alone. inter: a transport
    over the whole TP group."""

    name = "hierarchical"

    def __init__(self, topo: Topology, intra: Transport | None, intra_peers: Sequence[int],
                 inter: Transport):
        super().__init__(topo.rank, topo.world_size, inter.timeout)
        self.topology, self.intra, self.inter = topo, intra, inter
        self._intra_rank = {p: i for i, p in enumerate(intra_peers)} if intra is not None else {}
        self._labels = {"intra": f"intra:{intra.name}" if intra is not None else "",
                        "inter": f"inter:{inter.name}"}

    # -- who carries what --------------------------------------------------------------------
    def transport_for_peer(self, peer: Peer) -> Transport:
        return self.intra if peer in self._intra_rank and peer != self.rank else self.inter

    def via_for_peer(self, peer: Peer) -> str:
        return self._labels["intra" if self.transport_for_peer(peer) is self.intra else "inter"]

    def via(self, peers) -> str:
        if isinstance(peers, str):  # a collective over the group
            return self._labels["inter"]
        to, frm = peers
        return "+".join(sorted({self.via_for_peer(p) for p in (*to, *frm)})) or self._labels["inter"]

    @property
    def backends(self) -> tuple[str, ...]:
        parts = ([self.intra.name] if self.intra is not None else []) + [self.inter.name]
        return tuple(dict.fromkeys(parts))

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
        # Receive buffers must suit the intra transport (symmetric memory for symm); the
        # inter transport writes into any tensor. An inter transport that needs its own
        # symmetric heap (nvshmem) would provide the workspace here instead.
        return (self.intra or self.inter).workspace(shape, dtype, device)

    def begin_pass(self, name: str = "", comm_priority: int = 0) -> None:
        self.check()
        if self.intra is not None:
            self.intra.begin_pass(name, comm_priority)
        self.inter.begin_pass(name, comm_priority)

    def check(self) -> None:
        if self.intra is not None:
            self.intra.check()
        self.inter.check()

    # -- the four transfers ------------------------------------------------------------------
    def _start_exchange(self, sends, recvs: Sequence[SendRecv], op: str, chunk: int) -> Handle:
        parts: dict[int, tuple[Transport, list, list]] = {}
        for t, p, dst in sends:
            tp = self.transport_for_peer(p)
            parts.setdefault(id(tp), (tp, [], []))[1].append((t, self._local(tp, p), dst))
        for t, p in recvs:
            tp = self.transport_for_peer(p)
            parts.setdefault(id(tp), (tp, [], []))[2].append((t, self._local(tp, p)))
        handles = []
        for tp, s, r in parts.values():
            tp.check()
            handles.append(tp._start_exchange(s, r, op, chunk))
        return handles[0] if len(handles) == 1 else _All(handles)

    def _start_all_gather(self, out, inp, op, chunk) -> Handle:
        return self.inter._start_all_gather(out, inp, op, chunk)

    def _start_reduce_scatter(self, out, inp, op, chunk) -> Handle:
        return self.inter._start_reduce_scatter(out, inp, op, chunk)

    def _start_all_reduce(self, tensor, op, chunk) -> Handle:
        return self.inter._start_all_reduce(tensor, op, chunk)

    def _local(self, tp: Transport, peer: Peer) -> int:
        return self._intra_rank[peer] if tp is self.intra else peer


def build(group: dist.ProcessGroup, topo: Topology, device: torch.device | None,
          inter_backend: str = "torch_p2p") -> PerPeerTransport:
    """The per-peer transport of `group` (every rank of it calls this at once): symm
    inside a GPU domain where device is CUDA, torch_p2p inside it otherwise;
    `inter_backend` across domains."""
    if inter_backend not in INTER_BACKENDS:
        raise ValueError(f"megatron_overlap: inter-node backend '{inter_backend}' is not one of "
                         f"{INTER_BACKENDS}")
    mine = topo.domains[topo.domain[topo.rank]]
    intra: Transport | None = None
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
    if inter_backend == "nvshmem":  # another engineer's transport, same constructor shape
        from .nvshmem import NvshmemTransport
        inter: Transport = NvshmemTransport(group, device)
    else:
        inter = TorchP2PTransport(group)
    return PerPeerTransport(topo, intra, mine, inter)
