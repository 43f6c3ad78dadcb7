"""What install() set: the per-layer settings and the backend, read by every
overlapped layer when it is built (here, not in the integration, so that `layers`
reads it without importing `megatron`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Union

from .overlap import OverlapConfig

Source = Union[None, str, os.PathLike, Mapping[str, Any]]


@dataclass(frozen=True)
class State:
    settings: OverlapConfig
    rs_dgrad_settings: OverlapConfig  # TE's layer table when tp_comm_overlap_rs_dgrad is on
    backend: str
    source: Any = None


_state: Optional[State] = None


def make(ub_cfgs: Source, backend: str) -> State:
    return State(OverlapConfig.load(ub_cfgs), OverlapConfig.load(ub_cfgs, rs_dgrad=True),
                 backend, ub_cfgs)


def set_state(new: Optional[State]) -> Optional[State]:
    global _state
    old, _state = _state, new
    return old


def current() -> State:
    """The installed state; TE's defaults on `auto` when nothing was installed."""
    return _state if _state is not None else make(None, "auto")


def installed() -> bool:
    return _state is not None
