"""install() / uninstall(): the user-facing switch."""

from __future__ import annotations

import logging

from .. import comm, envvars
from ..config import OverlapConfig
from . import norms, state, swap

log = logging.getLogger("megatron_overlap")
_previous: list[state.State | None] = []


def install(ub_cfgs: state.Source = None, backend: str = "auto") -> OverlapConfig:
    """Turn the overlap on for layers built from now on: Megatron's TP linears
    built for the 'qkv' / 'proj' / 'fc1' / 'fc2' buffers of a config with
    `tp_comm_overlap=True` become overlapped, and torch norms accept sequence
    parallelism.

    ub_cfgs: None (Transformer Engine's defaults), a path to a TE-style
    `--tp-comm-overlap-cfg` YAML, or the same as a dict. backend: "auto" or a
    transport name. Returns the effective per-layer settings. Calling it again
    replaces the settings; uninstall() restores what was there before."""
    envvars.check_all()  # a bad MEGATRON_OVERLAP_* value fails here, naming it
    if backend != "auto":
        comm.resolve_backend(backend)  # fail now, not at the first forward
    new = state.make(ub_cfgs, backend)
    if not _previous:
        swap.patch()
        norms.patch()
    _previous.append(state.set_state(new))
    if log.isEnabledFor(logging.INFO):
        # per-peer transports: the table shows what the inter-node link honours
        shown = comm.resolve_backend(backend)
        shown = comm.inter_backend() if shown in comm.COMPOSITE else shown
        log.info("megatron_overlap installed (backend=%s)\n%s", backend, new.settings.table(shown))
    return new.settings


def uninstall() -> None:
    """Restore the state before the matching install(); a no-op when not installed."""
    if not _previous:
        return
    state.set_state(_previous.pop())
    if not _previous:
        swap.unpatch()
        norms.unpatch()
        comm.reset()
