"""Transports: how chunks move between the ranks of a TP group.

Owns the transport contract (`Transport`, `Handle`, `CommError`), one module per
backend (`torch_p2p`, `symm`, `nvshmem` on `heap`, `hierarchical` per peer, `null`
for compute only), the topology, the watchdog, traces and counters, and the cache of
one transport per (TP group, backend). The backend names come from
`config.backends`. Must not import GEMMs, autograd, Megatron (megatron.core,
megatron_overlap.megatron), the schedules (`overlap`), `layers` or any tool.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from ..config.backends import AUTO, BACKENDS, COMPOSITE, INTER_BACKENDS, REGISTRY
from ..config import env as envvars
from ..config.console import ranges
from . import topology as _topology
from .hierarchical import PerPeerTransport
from .null import NullTransport
from .topology import Topology, topology
from .torch_p2p import TorchP2PTransport
from .transport import CommError, ContractError, Handle, Transport

AVAILABLE = BACKENDS  # nvshmem needs nvshmem4py at run time
_cache: dict[tuple[dist.ProcessGroup, str], Transport] = {}
log = logging.getLogger("megatron_overlap")


_inter: str | None = None  # install(inter_backend=...)


def inter_backend() -> str:
    """The transport between domains of a per-peer transport: install()'s inter_backend,
    else MEGATRON_OVERLAP_INTER_BACKEND (checked), else torch_p2p (nvshmem where its
    transport is available)."""
    return _inter if _inter is not None else envvars.inter_backend()


def set_inter_backend(name: str | None) -> str | None:
    """Override the environment's default (None restores it); returns the previous override."""
    global _inter
    if name is not None and name not in INTER_BACKENDS:
        raise ValueError(f"megatron_overlap: inter_backend must be one of {INTER_BACKENDS}, "
                         f"not {name!r}")
    previous, _inter = _inter, name
    return previous


def _per_peer_pays(topo: Topology) -> bool:
    """Several domains, and some peers share one: two transports beat one."""
    return topo.is_hierarchical and any(len(d) > 1 for d in topo.domains)


def resolve_backend(backend: str, group: dist.ProcessGroup | None = None,
                    device: torch.device | None = None) -> str:
    """`auto` -> `hierarchical` (per-peer transports) for a group spread over several
    nodes / P2P domains, `symm` for a GPU group inside one domain, else `torch_p2p`
    (NCCL, gloo on CPU). Without a group: what auto means where nothing is known
    (torch_p2p). With a group of more than one rank, collective the first time."""
    if backend == AUTO:
        if group is None or dist.get_world_size(group) == 1:
            return "torch_p2p"
        topo = topology(group, device)
        if _per_peer_pays(topo):
            return "hierarchical"
        if device is not None and device.type == "cuda" and len(topo.domains) == 1:
            return "symm"
        return "torch_p2p"
    if backend in BACKENDS or backend in COMPOSITE:
        return backend
    raise ValueError(f"megatron_overlap: unknown backend '{backend}'; "
                     f"choose 'auto' or one of {BACKENDS + COMPOSITE}")


def transport_for(group: dist.ProcessGroup, backend: str = "auto",
                  device: torch.device | None = None) -> Transport:
    """One transport per (TP group, backend), shared by every layer that uses it.
    `device`: where the layer's tensors live (picks `auto`'s transport)."""
    name = resolve_backend(backend, group, device)
    key = (group, name)
    if key not in _cache:
        if name == "hierarchical":
            from .hierarchical import build
            tp = build(group, topology(group, device), device, inter_backend())
            log.info("megatron_overlap: TP group of %d ranks over %s: per-peer transports %s",
                     tp.world_size, tp.topology.describe(), describe_peers(tp))
            _cache[key] = tp
        elif REGISTRY[name].needs_cuda and (device is None or device.type != "cuda"):
            raise ValueError(f"megatron_overlap: backend '{name}' needs CUDA tensors, got {device}")
        elif name == "symm":
            from .symm import SymmTransport
            _cache[key] = SymmTransport(group, device)
        elif name == "nvshmem":
            from .nvshmem import NvshmemTransport
            _cache[key] = NvshmemTransport(group, device)
        else:
            _cache[key] = TorchP2PTransport(group)
    return _cache[key]


def describe_peers(tp: Transport) -> str:
    """Which transport carries each peer, as this rank sees it: 'intra:symm 1;
    inter:torch_p2p 2-3', or the one backend's name."""
    if not isinstance(tp, PerPeerTransport):
        return tp.name
    by: dict[str, list[int]] = {}
    for p, label in tp.peer_map().items():
        by.setdefault(label, []).append(p)
    return "; ".join(f"{label} {ranges(ps)}" for label, ps in by.items()) or tp.name


def reset() -> None:
    """Forget every transport and topology (uninstall, or a new process group). Transports
    holding a runtime (nvshmem) are closed: collective, as uninstall is on every rank."""
    for transport in list(_cache.values()):
        close = getattr(transport, "close", None)
        if close is not None:
            close()
    _cache.clear()
    _topology.reset()


__all__ = ["Transport", "Handle", "CommError", "ContractError", "TorchP2PTransport", "NullTransport",
           "PerPeerTransport", "Topology", "topology", "transport_for", "resolve_backend",
           "describe_peers", "reset", "AVAILABLE", "COMPOSITE", "INTER_BACKENDS"]
