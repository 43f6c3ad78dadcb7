"""Which ub_cfgs keys take effect, per method (TE's semantics) and per backend
(what this package's transports honour), so the console table can show every
key that is accepted but does nothing instead of dropping it silently.

TE semantics used (transformer_engine/common/comm_gemm_overlap/comm_gemm_overlap.cpp):
ring_exchange is CommOverlapP2P (tp_size chunks, use_ce and aggregate read, num_splits
not); pipeline and bulk are CommOverlap (num_splits read, use_ce forced off, aggregate
not passed); aggregate is read only by the split all-gather; rs_overlap_first_gemm only by
the pipelined reduce-scatter; an external layer only all-gathers on its dgrad partner's
streams; TE drops atomic_gemm for bulk/external with a warning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .errors import ConfigError, did_you_mean, listed
from .names import BACKENDS, EXTERNAL_PAIRS, KEYS

if TYPE_CHECKING:
    from .settings import LayerSettings

ACTIVE = "active"


@dataclass(frozen=True)
class BackendCaps:
    """What one transport of this package honours. Edit here when a backend learns a knob."""

    sm_kernels: bool  # comm runs in our own kernels whose grid is num_sm
    clusters: bool  # those kernels launch thread-block clusters of cga_size
    sm_margin: bool  # the GEMM can be held num_sm SMs short (set_sm_margin)
    copy_engine: bool  # ring-exchange chunks can move on copy engines (use_ce)
    comm_stream: bool  # communication runs on a stream we create (comm_priority)
    fp8: bool  # an FP8 communication buffer exists (fp8_buf)
    atomic_gemm: bool  # atomic (counter-synchronised) GEMM overlap exists
    why_no_sm: str = ""
    why_no_clusters: str = ""
    why_no_ce: str = ""
    why_no_comm_stream: str = ""


_NCCL_SMS = "NCCL picks its own SMs"
CAPS: dict[str, BackendCaps] = {
    "torch_p2p": BackendCaps(
        sm_kernels=False, clusters=False, sm_margin=False, copy_engine=False,
        comm_stream=False, fp8=False, atomic_gemm=False,
        why_no_sm=_NCCL_SMS, why_no_clusters=_NCCL_SMS + " and launch shape",
        why_no_ce="NCCL picks its own transport",
        why_no_comm_stream="NCCL runs on ProcessGroupNCCL's internal streams"),
    "symm": BackendCaps(
        sm_kernels=False, clusters=False, sm_margin=True, copy_engine=False,
        comm_stream=True, fp8=False, atomic_gemm=False,
        why_no_sm="its reductions are torch elementwise kernels, whose grid torch picks",
        why_no_clusters="its kernels launch without thread-block clusters",
        why_no_ce="ring_exchange chunks always move on copy engines (peer memcpy)"),
    "nvshmem": BackendCaps(
        sm_kernels=False, clusters=False, sm_margin=True, copy_engine=False,
        comm_stream=True, fp8=False, atomic_gemm=False,
        why_no_sm="its reductions are torch elementwise kernels, whose grid torch picks",
        why_no_clusters="its kernels launch without thread-block clusters",
        why_no_ce="host-initiated puts: NVSHMEM moves chunks on copy engines (P2P) "
                  "or through its proxy and the NIC (remote)"),
}
assert tuple(CAPS) == BACKENDS


def caps_for(backend: str) -> BackendCaps:
    if backend not in CAPS:
        raise ConfigError(f"unknown backend {backend!r}{did_you_mean(backend, BACKENDS)}; "
                          f"allowed backends: {listed(BACKENDS)}", key="backend", value=backend)
    return CAPS[backend]


def layer_effects(s: "LayerSettings", backend: str) -> dict[str, str]:
    """For each key of KEYS: "active" or the reason it does nothing for this layer."""
    caps = caps_for(backend)
    on_b = f"no effect on {backend}: "
    m = s.method
    external = (f"no effect: external all-gathers on {EXTERNAL_PAIRS.get(s.name, '?')}'s "
                "ring-exchange streams") if m == "external" else None
    ring_ce = m == "ring_exchange" and s.use_ce and caps.copy_engine

    def num_sm() -> str:
        if external:
            return external
        if not caps.sm_kernels:
            # Still read as the margin cuBLAS is held short by, where that exists.
            return ACTIVE if s.set_sm_margin and caps.sm_margin else on_b + caps.why_no_sm
        if ring_ce:
            return ("no effect: use_ce moves ring_exchange chunks on copy engines"
                    + (" (set_sm_margin still holds num_sm SMs back from the GEMM)"
                       if s.set_sm_margin and caps.sm_margin else ""))
        return ACTIVE

    def cga_size() -> str:
        if external:
            return external
        if not caps.clusters:
            return on_b + caps.why_no_clusters
        if ring_ce:
            return "no effect: copy-engine transfers launch no kernels"
        if s.num_sm % s.cga_size:  # TE's SETUP_LAUNCH_CONFIG falls back to clusters of 1
            return (f"fallback: clusters of 1 (num_sm {s.num_sm} is not a multiple of "
                    f"cga_size {s.cga_size})")
        return ACTIVE

    def set_sm_margin() -> str:
        if external:
            return "no effect: external runs no GEMM of its own in the overlap"
        if not caps.sm_margin:
            return on_b + caps.why_no_sm + ", so there are no num_sm SMs to hold back"
        return ACTIVE

    def num_splits() -> str:
        if m == "ring_exchange":
            return "no effect: ring_exchange uses TP chunks"
        if m == "bulk":
            return "no effect: bulk moves the whole buffer under one GEMM"
        return external or ACTIVE

    def atomic_gemm() -> str:
        if not s.atomic_gemm:
            return (ACTIVE if caps.atomic_gemm
                    else "no effect: atomic GEMM not implemented (always non-atomic)")
        if m in ("bulk", "external"):
            return f"fallback: non-atomic GEMM (TE ignores atomic_gemm for {m})"
        if not caps.atomic_gemm:
            return "fallback: non-atomic GEMM (atomic GEMM not implemented)"
        return ACTIVE

    def use_ce() -> str:
        if external:
            return external
        if m != "ring_exchange":
            return f"no effect: only ring_exchange can use copy engines (TE runs {m} on SMs)"
        if not caps.copy_engine:
            return on_b + caps.why_no_ce
        return ACTIVE

    def aggregate() -> str:
        if m != "ring_exchange" or s.is_reduce_scatter:
            return "no effect: aggregate only applies to a ring_exchange all-gather"
        if s.atomic_gemm and caps.atomic_gemm:
            return "no effect: the atomic all-gather GEMM does not aggregate"
        return ACTIVE

    def fp8_buf() -> str:
        return ACTIVE if caps.fp8 else "no effect: no FP8 path"

    def priority(key: str) -> str:
        if external:
            return external
        if key == "comm_priority" and not caps.comm_stream:
            return on_b + caps.why_no_comm_stream
        value = getattr(s, key)
        if value > 0:
            return f"clamped: CUDA stream priorities are <= 0, so {value} acts as 0 (lowest)"
        return ACTIVE

    def ring_order() -> str:
        if m in ("bulk", "external"):
            return f"no effect: {m} runs no ring"
        return ACTIVE

    def gemm_streams() -> str:
        if m in ("bulk", "external"):
            return f"no effect: {m} runs one GEMM"
        return ACTIVE

    def first_gemm() -> str:
        if m != "pipeline":
            return "no effect: only the pipeline reduce-scatter reads it"
        if s.atomic_gemm and caps.atomic_gemm:
            return "no effect: the atomic pipeline does not read it"
        return ACTIVE

    out = {
        "method": ACTIVE, "num_sm": num_sm(), "cga_size": cga_size(),
        "set_sm_margin": set_sm_margin(), "num_splits": num_splits(),
        "atomic_gemm": atomic_gemm(), "use_ce": use_ce(), "aggregate": aggregate(),
        "fp8_buf": fp8_buf(), "comm_priority": priority("comm_priority"),
        "gemm_priority": priority("gemm_priority"),
        "pipeline_rs_overlap_first_gemm": first_gemm(),
        "ring_order": ring_order(), "gemm_streams": gemm_streams(),
    }
    assert tuple(out) == KEYS
    return out
