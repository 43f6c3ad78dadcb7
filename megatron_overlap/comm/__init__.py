"""Transports: how chunks move between the ranks of a TP group."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from .null import NullTransport
from .torch_p2p import TorchP2PTransport
from .transport import CommError, Handle, Transport

AVAILABLE = ("torch_p2p", "symm")
PLANNED = ("nvshmem",)
_cache: dict[tuple[dist.ProcessGroup, str], Transport] = {}
_domains: dict[dist.ProcessGroup, bool] = {}


def symm_domain(group: dist.ProcessGroup, device: torch.device) -> bool:
    """Whether every rank of `group` can map every peer's GPU memory: one host, and
    devices with P2P access to each other (the same device for ranks that share one
    GPU, which torch allows with TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1).
    Collective over `group`."""
    if group not in _domains:
        peers: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(peers, (socket.gethostname(), device.index), group=group)
        devices = sorted({d for _, d in peers})
        shared = len(devices) < len(peers)
        _domains[group] = (
            len({h for h, _ in peers}) == 1
            and (not shared or os.environ.get("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES") == "1")
            and all(a == b or torch.cuda.can_device_access_peer(a, b) for a in devices for b in devices))
    return _domains[group]


def resolve_backend(backend: str, group: dist.ProcessGroup | None = None,
                    device: torch.device | None = None) -> str:
    """`auto` -> `symm` for a GPU group inside one NVLink / P2P domain, else
    `torch_p2p` (NCCL across nodes, gloo on CPU). Without a group: what auto means
    where nothing is known (torch_p2p)."""
    if backend == "auto":
        if (group is not None and device is not None and device.type == "cuda"
                and dist.get_world_size(group) > 1 and symm_domain(group, device)):
            return "symm"
        return "torch_p2p"
    if backend in AVAILABLE:
        return backend
    if backend in PLANNED:
        raise NotImplementedError(
            f"megatron_overlap: backend '{backend}' is not available in this build; "
            f"use one of {AVAILABLE} or 'auto'")
    raise ValueError(f"megatron_overlap: unknown backend '{backend}'; "
                     f"choose 'auto' or one of {AVAILABLE + PLANNED}")


def transport_for(group: dist.ProcessGroup, backend: str = "auto",
                  device: torch.device | None = None) -> Transport:
    """One transport per (TP group, backend), shared by every layer that uses it.
    `device`: where the layer's tensors live (picks `auto`'s transport)."""
    name = resolve_backend(backend, group, device)
    key = (group, name)
    if key not in _cache:
        if name == "symm":
            if device is None or device.type != "cuda":
                raise ValueError(f"megatron_overlap: backend 'symm' needs CUDA tensors, got {device}")
            from .symm import SymmTransport
            _cache[key] = SymmTransport(group, device)
        else:
            _cache[key] = TorchP2PTransport(group)
    return _cache[key]


def reset() -> None:
    """Forget every transport (uninstall, or a new process group)."""
    _cache.clear()
    _domains.clear()


__all__ = ["Transport", "Handle", "CommError", "TorchP2PTransport", "NullTransport", "transport_for",
           "resolve_backend", "symm_domain", "reset", "AVAILABLE"]
