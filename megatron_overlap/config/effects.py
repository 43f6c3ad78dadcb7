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

from typing import TYPE_CHECKING

from .backends import BACKENDS, REGISTRY, BackendCaps
from .errors import ConfigError, did_you_mean, listed
from .names import EXTERNAL_PAIRS, KEYS

if TYPE_CHECKING:
    from .settings import LayerSettings

ACTIVE = "active"
CAPS: dict[str, BackendCaps] = {name: b.caps for name, b in REGISTRY.items()}
# Keys no backend of this package honours (config.backends.BackendCaps says why).
NO_ATOMIC = "no effect: atomic GEMM not implemented (always non-atomic)"
# An FP8 layer (Megatron's config.fp8) quantizes what it gathers before the gather and
# reduces in the output dtype, whatever fp8_buf says; a bf16 layer moves bf16.
NO_FP8 = "no effect: FP8 layers (config.fp8) gather FP8 and reduce bf16 regardless"
# what a chunk GEMM's stream keys do where wait_gemm runs the ring's one GEMM
WAITS = "no effect: wait_gemm runs one GEMM, on the pass's stream"


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

    def num_sm() -> str:
        if external:
            return external
        # No backend launches communication kernels of num_sm SMs: it is read only as
        # the margin cuBLAS is held short by, where that exists.
        return ACTIVE if s.set_sm_margin and caps.sm_margin else on_b + caps.why_no_sm

    def cga_size() -> str:
        return external or on_b + caps.why_no_clusters

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
            return NO_ATOMIC
        if m in ("bulk", "external"):
            return f"fallback: non-atomic GEMM (TE ignores atomic_gemm for {m})"
        return "fallback: non-atomic GEMM (atomic GEMM not implemented)"

    def use_ce() -> str:
        if external:
            return external
        if m != "ring_exchange":
            return f"no effect: only ring_exchange can use copy engines (TE runs {m} on SMs)"
        return on_b + caps.why_no_ce

    def aggregate() -> str:
        if not s.is_ring_all_gather:
            return "no effect: aggregate only applies to a ring_exchange all-gather"
        return ACTIVE

    def priority(key: str) -> str:
        if external:
            return external
        if key == "comm_priority" and not caps.comm_stream:
            return on_b + caps.why_no_comm_stream
        if key == "gemm_priority" and waits():
            return WAITS
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
        if waits():
            return WAITS
        return ACTIVE

    def waits() -> bool:
        """The layer runs one waiting GEMM where it can (its chunk-GEMM keys then unread)."""
        return s.wait_gemm and s.is_ring_all_gather and not caps.why_no_wait

    def wait_gemm() -> str:
        if not s.is_ring_all_gather:
            return "no effect: only a ring_exchange all-gather runs one waiting GEMM"
        if caps.why_no_wait:
            return (f"fallback: the ring's chunk GEMMs ({backend}: {caps.why_no_wait})"
                    if s.wait_gemm else on_b + caps.why_no_wait)
        return ACTIVE

    def first_gemm() -> str:
        if m != "pipeline":
            return "no effect: only the pipeline reduce-scatter reads it"
        return ACTIVE

    out = {
        "method": ACTIVE, "num_sm": num_sm(), "cga_size": cga_size(),
        "set_sm_margin": set_sm_margin(), "num_splits": num_splits(),
        "atomic_gemm": atomic_gemm(), "use_ce": use_ce(), "aggregate": aggregate(),
        "fp8_buf": NO_FP8, "comm_priority": priority("comm_priority"),
        "gemm_priority": priority("gemm_priority"),
        "pipeline_rs_overlap_first_gemm": first_gemm(),
        "ring_order": ring_order(), "gemm_streams": gemm_streams(), "wait_gemm": wait_gemm(),
    }
    assert tuple(out) == KEYS
    return out
