"""Which overlap backends a benchmark runs on this machine, and why the others not.

`auto` means every backend that can work on the layout: one rank per GPU: symm,
torch_p2p (NCCL), and nvshmem once its module is in the build
(`megatron_overlap.comm.AVAILABLE`); ranks sharing a GPU: symm only (NCCL and
NVSHMEM refuse several processes per GPU); CPU: torch_p2p (gloo).
"""

from __future__ import annotations

from .. import comm
from .launch import Layout

ORDER = ("symm", "nvshmem", "torch_p2p")


def select(spec: str, layout: Layout, emulated_nodes: bool = False
           ) -> tuple[list[str], dict[str, str]]:
    """(backends to run, {backend: why it is left out}) for `spec` ('auto' or a comma
    list). `emulated_nodes`: the group spans emulated nodes; `auto` then runs the
    per-peer transport and NCCL alone, not a flat symm / nvshmem ring that would
    cross the emulated node boundary over NVLink."""
    skipped: dict[str, str] = {}
    if spec == "auto" and emulated_nodes:
        for b in ("symm", "nvshmem"):
            skipped[b] = "emulated nodes: a flat ring over one symmetric heap would cross them"
        return ["hierarchical", "torch_p2p"], skipped
    if spec == "auto":
        wanted = {"gpus": list(ORDER), "shared_gpu": ["symm"], "cpu": ["torch_p2p"]}[layout.mode]
        if layout.mode == "shared_gpu":
            skipped["torch_p2p"] = "ranks share a GPU: NCCL refuses it (gloo has no CUDA send/recv)"
            skipped["nvshmem"] = "ranks share a GPU: NVSHMEM refuses several processes per GPU"
        if layout.mode == "cpu":
            skipped["symm"] = "needs CUDA tensors"
    else:
        wanted = [b.strip() for b in spec.split(",") if b.strip()]
    out = []
    composite = tuple(getattr(comm, "COMPOSITE", ()))  # per-peer transports (hierarchical)
    for b in wanted:
        if b not in comm.AVAILABLE + composite and b not in ORDER:
            raise SystemExit(f"unknown backend {b!r}: auto or a comma list of {ORDER + composite}")
        if b in composite:
            out.append(b)
        elif b not in comm.AVAILABLE:
            skipped[b] = f"not in this build (megatron_overlap.comm.AVAILABLE = {comm.AVAILABLE})"
        elif b in ("symm", "nvshmem") and layout.mode == "cpu":
            skipped[b] = "needs CUDA tensors"
        elif b == "nvshmem" and layout.mode == "shared_gpu":
            skipped[b] = "ranks share a GPU: NVSHMEM refuses several processes per GPU"
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
