"""LayerSettings: the overlap settings of one GEMM, validated on construction so
that no invalid combination can exist past the config layer."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from . import effects as _effects
from .errors import bad_value, did_you_mean, listed, unknown_layer
from .names import (
    AGGREGATE_AUTO, AGGREGATE_MIN_N, BULK_LAYERS, EXTENSION_DEFAULTS, EXTERNAL_PAIRS, LAYER_NAMES, MAX_CGA_SIZE, MAX_GEMM_STREAMS,
    METHODS,
    RING_ORDERS, TE_PIPELINE_SPLITS, is_reduce_scatter, te_defaults,
)

_WGRAD_BULK_ONLY = frozenset(BULK_LAYERS) - {"qkv_dgrad", "fc1_dgrad"}


def method_error(name: str, method: str) -> str | None:
    """Why `method` cannot drive layer `name`, or None when it can.

    TE's own checks in initialize_ub: `pipeline` is refused for all-gather layers and
    proj_wgrad/fc2_wgrad must be `external`. The others are refused here because TE accepts
    them at init and then fails (or quietly runs another algorithm) in the first GEMM:
    bulk/external objects cannot do a split all-gather, a ring-exchange object cannot do a
    bulk wgrad, and a bulk or external label on a GEMM+RS layer runs TE's pipeline path.
    """
    if name in EXTERNAL_PAIRS and method != "external":
        return (f"TE requires `external` for {name}: it all-gathers on "
                f"{EXTERNAL_PAIRS[name]}'s ring-exchange streams")
    if name in _WGRAD_BULK_ONLY and method != "bulk":
        return f"{name} only overlaps the dgrad reduce-scatter in bulk (TE calls bulk_overlap on it)"
    if method == "pipeline" and not is_reduce_scatter(name, method):
        return (f"{name} is an all-gather overlap and TE rejects `pipeline` for all-gather "
                "(\"`pipeline` overlap method is not supported for AllGather\")")
    if method == "external" and name not in EXTERNAL_PAIRS:
        return f"`external` is only for {listed(EXTERNAL_PAIRS)}"
    if method == "bulk" and name not in BULK_LAYERS:
        return f"`bulk` is only for {listed(sorted(BULK_LAYERS, key=LAYER_NAMES.index))}"
    return None


def allowed_methods(name: str) -> tuple[str, ...]:
    return tuple(m for m in METHODS if method_error(name, m) is None)


_BOOL_KEYS = frozenset({"set_sm_margin", "atomic_gemm", "use_ce", "aggregate", "fp8_buf",
                        "pipeline_rs_overlap_first_gemm", "is_reduce_scatter", "wait_gemm"})
_INT_RANGES = {  # key -> (lowest, highest or None, what the message says is allowed)
    "num_sm": (1, None, "an int >= 1"),
    "cga_size": (1, MAX_CGA_SIZE, f"an int in 1..{MAX_CGA_SIZE} (CUDA's portable cluster size)"),
    "num_splits": (1, None, "an int >= 1, or null for TE's default"),
    "comm_priority": (None, None, "an int (CUDA stream priority; 0 and lower)"),
    "gemm_priority": (None, None, "an int (CUDA stream priority; 0 and lower)"),
    "gemm_streams": (0, MAX_GEMM_STREAMS, f"an int in 0..{MAX_GEMM_STREAMS} (0: the global "
                     f"default, install(gemm_streams=...) or MEGATRON_OVERLAP_GEMM_STREAMS)"),
}


def coerce(layer: str, key: str, value: Any) -> Any:
    """Check one key's type and range and return it normalised (0/1 -> bool)."""
    if key == "method":
        if not (isinstance(value, str) and value in METHODS):
            raise bad_value(layer, key, value, listed(METHODS), did_you_mean(value, METHODS))
        return value
    if key == "ring_order":
        if not (isinstance(value, str) and value in RING_ORDERS):
            raise bad_value(layer, key, value, listed(RING_ORDERS), did_you_mean(value, RING_ORDERS))
        return value
    if key == "aggregate" and value == AGGREGATE_AUTO:
        return value
    if key in _BOOL_KEYS:
        if isinstance(value, int) and value in (0, 1):  # bool is an int too
            return bool(value)
        raise bad_value(layer, key, value, "true/false or 0/1"
                        + (f", or {AGGREGATE_AUTO} (the default)" if key == "aggregate" else ""))
    if key == "num_splits" and value is None:
        return None
    low, high, what = _INT_RANGES[key]
    if (not isinstance(value, int) or isinstance(value, bool)
            or (low is not None and value < low) or (high is not None and value > high)):
        raise bad_value(layer, key, value, what)
    return value


@dataclass(frozen=True)
class LayerSettings:
    """One GEMM's overlap settings, with TE's ub_cfgs keys as fields."""

    name: str
    method: str
    num_sm: int
    cga_size: int
    set_sm_margin: bool
    num_splits: int | None  # None: TE's default (TP size for ring_exchange, else 4)
    atomic_gemm: bool
    use_ce: bool
    aggregate: bool | str  # TE's true / false, or ours, "auto" (`aggregates`)
    fp8_buf: bool
    comm_priority: int  # 0 and gemm_priority 0: TE's default (comm highest, GEMM lowest)
    gemm_priority: int
    pipeline_rs_overlap_first_gemm: bool
    # ours, not TE's: the ring's order over the TP group's nodes (auto | flat | hierarchical)
    ring_order: str = "auto"
    # ours: streams the chunk GEMMs round-robin over (0: the global default)
    gemm_streams: int = 0
    # ours: a ring all-gather's GEMM as one kernel whose tiles wait per block
    wait_gemm: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or self.name not in LAYER_NAMES:
            raise unknown_layer(self.name, LAYER_NAMES)
        for f in fields(self)[1:]:
            object.__setattr__(self, f.name, coerce(self.name, f.name, getattr(self, f.name)))
        why = method_error(self.name, self.method)
        if why:
            raise bad_value(self.name, "method", self.method,
                            listed(allowed_methods(self.name)), f" ({why})")

    @classmethod
    def default(cls, name: str, method: str | None = None) -> "LayerSettings":
        """TE's get_default_config() for `name`, for `method` (default: TE's method for it)."""
        if name not in LAYER_NAMES:
            raise unknown_layer(name, LAYER_NAMES)
        if method is not None:
            coerce(name, "method", method)
        return cls(name=name, **te_defaults(name, method))

    @classmethod
    def te_default(cls, name: str, method: str | None = None) -> "LayerSettings":
        """TE's get_default_config() as TE itself reads it: `default`, with TE's `aggregate`
        (false) where ours is "auto"."""
        return replace(cls.default(name, method), aggregate=False)

    @property
    def buffer_name(self) -> str:
        return self.name.split("_")[0]

    @property
    def pass_name(self) -> str:
        return self.name.split("_")[1]

    @property
    def is_reduce_scatter(self) -> bool:
        """TE's classification: GEMM+reduce-scatter (True) or all-gather+GEMM (False)."""
        return is_reduce_scatter(self.name, self.method)

    @property
    def is_ring_all_gather(self) -> bool:
        """A ring_exchange all-gather: the passes `aggregate` and `wait_gemm` act on."""
        return self.method == "ring_exchange" and not self.is_reduce_scatter

    def splits(self, tp_size: int) -> int:
        """Chunks the GEMM and its communication are cut into: TP size for a ring exchange,
        num_splits (TE default 4) for a pipeline, 1 for bulk/external (one whole transfer).
        With aggregate, a ring exchange still moves tp_size chunks but runs them as GEMMs
        on pairs."""
        if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
            raise bad_value(self.name, "tp_size", tp_size, "an int >= 1")
        if self.method == "ring_exchange":
            return tp_size
        if self.method == "pipeline":
            return self.num_splits if self.num_splits is not None else TE_PIPELINE_SPLITS
        return 1

    def aggregates(self, n: int, tp: int, nodes: int = 1) -> bool:
        """Whether this pass, a ring all-gather whose GEMM has `n` output columns per rank,
        runs TE's pairs at TP size `tp` over `nodes` nodes: `aggregate` as given, or for
        "auto" where a block's GEMM outlasts its transfer over NVLink (n >= AGGREGATE_MIN_N,
        config.names) at an even TP > 2 (at 2 the pairs are the plain ring) inside one node
        (a flat ring across nodes moves blocks over the network, several times slower).
        False for any other pass."""
        if not self.is_ring_all_gather:
            return False
        if self.aggregate == AGGREGATE_AUTO:
            return n >= AGGREGATE_MIN_N and tp > 2 and tp % 2 == 0 and nodes == 1
        return bool(self.aggregate)

    def resolved(self, n: int, tp: int, nodes: int = 1) -> "LayerSettings":
        """These settings as a pass of `n` GEMM columns per rank at TP `tp` over `nodes`
        nodes runs them: `aggregate` true or false (`aggregates`)."""
        return replace(self, aggregate=self.aggregates(n, tp, nodes))

    def effects(self, backend: str) -> dict[str, str]:
        """For every ub_cfgs key: "active", or why it has no effect with this method on
        `backend` ("no effect: ...", "fallback: ...", "clamped: ...")."""
        return _effects.layer_effects(self, backend)

    def stream_priorities(self, least: int, greatest: int) -> tuple[int, int]:
        """(comm, gemm) CUDA stream priorities given the device range (least, greatest), as
        torch.cuda.Stream.priority_range() returns it: 0/0 means TE's default (comm gets the
        greatest priority, the GEMM the least); other values are clamped into the range like
        CUDA does."""
        if self.comm_priority == 0 and self.gemm_priority == 0:
            return greatest, least
        lo, hi = min(least, greatest), max(least, greatest)
        return (min(max(self.comm_priority, lo), hi), min(max(self.gemm_priority, lo), hi))

    def to_dict(self) -> dict[str, Any]:
        """This layer as a TE ub_cfgs entry (every key explicit, so TE's own defaulting
        cannot change its meaning; num_splits left out when it is TE's default; our own
        keys left out at their defaults, so TE, which refuses them, reads the rest; so is
        `aggregate` "auto", which TE would refuse: TE then reads its default, false)."""
        out = asdict(self)
        del out["name"]
        if out["num_splits"] is None:
            del out["num_splits"]
        if out["aggregate"] == AGGREGATE_AUTO:
            del out["aggregate"]
        for key, default in EXTENSION_DEFAULTS.items():
            if out[key] == default:
                del out[key]
        return out
