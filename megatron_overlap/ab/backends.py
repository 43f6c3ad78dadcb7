"""Which overlap backends a benchmark runs on this machine, and why the others not.

`auto` means every backend of the registry (`config.backends`) that can work on the
layout, the GPU-only transports first: one rank per GPU: symm, nvshmem, torch_p2p
(NCCL); ranks sharing a GPU: those without a `shared_gpu` refusal (symm); CPU: those
without `needs_cuda` (torch_p2p over gloo).
"""

from __future__ import annotations

from .. import comm
from ..config.backends import BACKENDS, COMPOSITE, REGISTRY
from .launch import Layout

ORDER = tuple(sorted(BACKENDS, key=lambda b: not REGISTRY[b].needs_cuda))


def _why_not(backend: str, layout: Layout) -> str:
    """Why `backend` cannot run on `layout` ("" when it can)."""
    b = REGISTRY[backend]
    if layout.mode == "cpu" and b.needs_cuda:
        return b.needs_cuda
    return b.shared_gpu if layout.mode == "shared_gpu" else ""


def select(spec: str, layout: Layout, emulated_nodes: bool = False
           ) -> tuple[list[str], dict[str, str]]:
    """(backends to run, {backend: why it is left out}) for `spec` ('auto' or a comma
    list). `emulated_nodes`: the group spans emulated nodes; `auto` then runs the
    per-peer transport and NCCL alone, not a flat symm / nvshmem ring that would
    cross the emulated node boundary over NVLink."""
    skipped: dict[str, str] = {}
    if spec == "auto" and emulated_nodes:
        heaps = [b for b in ORDER if REGISTRY[b].needs_cuda]
        skipped = {b: "emulated nodes: a flat ring over one symmetric heap would cross them"
                   for b in heaps}
        return list(COMPOSITE) + [b for b in ORDER if b not in heaps], skipped
    wanted = list(ORDER) if spec == "auto" else [b.strip() for b in spec.split(",") if b.strip()]
    out = []
    for b in wanted:
        if b not in BACKENDS + COMPOSITE:
            raise SystemExit(f"unknown backend {b!r}: auto or a comma list of {ORDER + COMPOSITE}")
        why = "" if b in COMPOSITE else _why_not(b, layout)
        if why:
            skipped[b] = why
        else:
            out.append(b)
    return out, skipped


def usable(names: list[str], group, device) -> tuple[list[str], dict[str, str]]:
    """Build each backend's transport on `group` once (it is cached for the layers and
    schedules that follow); a backend that fails on any rank is left out, with the
    first failure as the reason (e.g. nvshmem without nvshmem4py). Collective."""

    local: dict[str, str | None] = {}
    for b in names:
        try:
            comm.transport_for(group, b, device)
            local[b] = None
        except Exception as exc:  # reported in the results, not fatal
            local[b] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    from ..comm.exchange import all_gather_object

    everyone = all_gather_object(local, group, "backend availability")
    failed = {b: next(f"rank {r}: {e[b]}" for r, e in enumerate(everyone) if e[b])
              for b in names if any(e[b] for e in everyone)}
    return [b for b in names if b not in failed], failed
