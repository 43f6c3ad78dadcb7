"""Where the ranks of one TP group live: node and NVLink / P2P domain of each peer.

- Node: `global rank // LOCAL_WORLD_SIZE` when torchrun's LOCAL_WORLD_SIZE is set
  (which also lets tests emulate nodes on one machine), else the host name.
- Domain: ranks of one node whose GPUs all map each other's memory (device P2P
  access both ways; ranks that share one GPU only with
  TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1, as torch symmetric memory needs).
  On CPU a domain is the node.

One bounded exchange over the group (`exchange.all_gather_object`) learns it (cached per group and device);
TP groups may be non-contiguous in global ranks, span nodes, and hold unequal
numbers of ranks per node.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..config import env as envvars
from .exchange import all_gather_object

_cache: dict[tuple[dist.ProcessGroup, str], "Topology"] = {}


@dataclass(frozen=True)
class Topology:
    """Per group rank: node id, domain id (both numbered in order of first appearance
    in group-rank order, so group rank 0 is on node 0, domain 0) and local index (the
    rank's position among its domain's ranks, in group-rank order)."""

    rank: int
    node: tuple[int, ...]
    domain: tuple[int, ...]
    local: tuple[int, ...]

    @property
    def world_size(self) -> int:
        return len(self.node)

    @property
    def nodes(self) -> tuple[tuple[int, ...], ...]:
        """Group ranks per node, node by node."""
        return _members(self.node)

    @property
    def domains(self) -> tuple[tuple[int, ...], ...]:
        """Group ranks per P2P domain: what one intra-domain transport can reach."""
        return _members(self.domain)

    @property
    def is_hierarchical(self) -> bool:
        """More than one domain: some peers need a slower transport than others."""
        return len(self.domains) > 1

    @property
    def spans_nodes(self) -> bool:
        return len(self.nodes) > 1

    @property
    def uniform(self) -> bool:
        """Every domain holds the same number of the group's ranks (what the
        hierarchical ring order needs: N domains x L local ranks)."""
        return len({len(d) for d in self.domains}) == 1

    def describe(self) -> str:
        """'2 nodes x 4 ranks', '1 node, 2 domains x 2 ranks', '3 nodes (2+1+1 ranks)'."""
        def count(groups: tuple[tuple[int, ...], ...], what: str) -> str:
            sizes = [len(g) for g in groups]
            unit = what if len(groups) == 1 else what + "s"
            if len(set(sizes)) == 1:
                return f"{len(groups)} {unit} x {sizes[0]} rank{'s' if sizes[0] > 1 else ''}"
            return f"{len(groups)} {unit} ({'+'.join(map(str, sizes))} ranks)"
        if self.domains == self.nodes:
            return count(self.nodes, "node")
        return f"{len(self.nodes)} node{'s' if self.spans_nodes else ''}, " + count(self.domains, "domain")


def _members(ids: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    out: dict[int, list[int]] = {}
    for r, i in enumerate(ids):
        out.setdefault(i, []).append(r)
    return tuple(tuple(v) for _, v in sorted(out.items()))


def _number(keys: list) -> tuple[int, ...]:
    """Keys -> small ints in order of first appearance."""
    seen: dict = {}
    return tuple(seen.setdefault(k, len(seen)) for k in keys)


def node_key(global_rank: int) -> str:
    lws = envvars.local_world_size()
    if lws:
        return f"node{global_rank // lws}"
    return socket.gethostname()


def _device_info(device: torch.device | None) -> tuple | None:
    """(this GPU's id, {peer GPU id: P2P access}, may share a GPU) or None on CPU."""
    if device is None or device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()

    def gpu_id(i: int) -> str:  # physical id: robust to per-process CUDA_VISIBLE_DEVICES
        uuid = getattr(torch.cuda.get_device_properties(i), "uuid", None)
        return str(uuid) if uuid is not None else f"cuda:{i}"

    access = {gpu_id(o): o == index or torch.cuda.can_device_access_peer(index, o)
              for o in range(torch.cuda.device_count())}
    return gpu_id(index), access, os.environ.get("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES") == "1"


def _domains(node: tuple[int, ...], devices: list) -> tuple[int, ...]:
    """Greedy, in group-rank order: a rank joins the first domain of its node all of
    whose members it can share memory with, else starts a new one."""
    if all(d is None for d in devices):
        return node

    def compatible(a: int, b: int) -> bool:
        (ga, acc_a, share_a), (gb, acc_b, share_b) = devices[a], devices[b]
        if ga == gb:
            return share_a and share_b
        return bool(acc_a.get(gb)) and bool(acc_b.get(ga))

    groups: list[list[int]] = []
    keys = []
    for r in range(len(node)):
        home = next((i for i, g in enumerate(groups) if node[g[0]] == node[r]
                     and devices[r] is not None and all(devices[m] is not None
                                                        and compatible(r, m) for m in g)), None)
        if home is None:
            groups.append([r])
            home = len(groups) - 1
        else:
            groups[home].append(r)
        keys.append(home)
    return _number(keys)


def from_peers(rank: int, peers: list[tuple[str, tuple | None]]) -> Topology:
    """The topology from every group rank's (node key, device info): the pure part,
    separate from the collective so it can be tested on its own."""
    node = _number([k for k, _ in peers])
    domain = _domains(node, [d for _, d in peers])
    seen: dict[int, int] = {}
    local = []
    for d in domain:
        local.append(seen.get(d, 0))
        seen[d] = local[-1] + 1
    return Topology(rank, node, domain, tuple(local))


def topology(group: dist.ProcessGroup, device: torch.device | None = None) -> Topology:
    """The topology of `group` as seen from this rank. Collective over `group` the
    first time (every rank must call it), cached afterwards."""
    key = (group, str(device))
    if key not in _cache:
        rank = dist.get_rank(group)
        mine = (node_key(dist.get_global_rank(group, rank)), _device_info(device))
        # bounded: a peer that never comes is a CommError naming it, not a hang
        peers = all_gather_object(mine, group, "topology exchange before the first forward")
        _cache[key] = from_peers(rank, peers)
    return _cache[key]


def reset() -> None:
    _cache.clear()
