"""Transports: how chunks move between the ranks of a TP group."""

from __future__ import annotations

import torch.distributed as dist

from .null import NullTransport
from .torch_p2p import TorchP2PTransport
from .transport import CommError, Handle, Transport

AVAILABLE = ("torch_p2p",)
PLANNED = ("symm", "nvshmem")
_cache: dict[tuple[dist.ProcessGroup, str], Transport] = {}


def resolve_backend(backend: str) -> str:
    """`auto` -> the best transport present for this group (today: torch_p2p)."""
    if backend == "auto":
        return "torch_p2p"
    if backend in AVAILABLE:
        return backend
    if backend in PLANNED:
        raise NotImplementedError(
            f"megatron_overlap: backend '{backend}' is not available in this build; "
            f"use one of {AVAILABLE} or 'auto'")
    raise ValueError(f"megatron_overlap: unknown backend '{backend}'; "
                     f"choose 'auto' or one of {AVAILABLE + PLANNED}")


def transport_for(group: dist.ProcessGroup, backend: str = "auto") -> Transport:
    """One transport per (TP group, backend), shared by every layer that uses it."""
    name = resolve_backend(backend)
    key = (group, name)
    if key not in _cache:
        _cache[key] = TorchP2PTransport(group)
    return _cache[key]


def reset() -> None:
    """Forget every transport (uninstall, or a new process group)."""
    _cache.clear()


__all__ = ["Transport", "Handle", "CommError", "TorchP2PTransport", "NullTransport", "transport_for",
           "resolve_backend", "reset", "AVAILABLE"]
