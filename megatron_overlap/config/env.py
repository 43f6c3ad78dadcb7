"""Checked readers of the environment variables the package reads.

Each reader returns the typed value or raises `EnvError`, which names the
variable, the value found and what is allowed. Meanings:

- unset or empty (whitespace only): the default;
- MEGATRON_OVERLAP_TIMEOUT_S: seconds, a finite number in (0, MAX_TIMEOUT_S].
  0, negative, nan, inf and anything that is not a number are refused: every
  wait must be bounded, and a timeout that cannot fire would be a hang;
- MEGATRON_OVERLAP_GEMM_STREAMS: an integer in [1, MAX_GEMM_STREAMS];
- MEGATRON_OVERLAP_INTER_BACKEND: one of INTER_BACKENDS;
- MEGATRON_OVERLAP_GRAPHS: 1 / 0 (also true/false, on/off, yes/no): whole-pass
  CUDA-graph replay on or off;
- LOCAL_WORLD_SIZE (torchrun's, read for the topology): an integer >= 1.

`install(timeout_s=...)` overrides the timeout for the process (`set_timeout_s`;
`timeout_s()` is what every wait reads); the variable stays the default.
"""

from __future__ import annotations

import math
import os

from .backends import INTER_BACKENDS
from .names import DEFAULT_GEMM_STREAMS, MAX_GEMM_STREAMS

TIMEOUT_S = "MEGATRON_OVERLAP_TIMEOUT_S"
GEMM_STREAMS = "MEGATRON_OVERLAP_GEMM_STREAMS"
INTER_BACKEND = "MEGATRON_OVERLAP_INTER_BACKEND"
GRAPHS = "MEGATRON_OVERLAP_GRAPHS"
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"

DEFAULT_TIMEOUT_S = 300.0
MAX_TIMEOUT_S = 7 * 24 * 3600.0  # a week: beyond it torch's millisecond timeouts stop meaning much


class EnvError(ValueError):
    """An environment variable holds a value the package cannot use."""

    def __init__(self, name: str, value: str, allowed: str) -> None:
        super().__init__(f"megatron_overlap: environment variable {name}={value!r} is not "
                         f"usable; allowed: {allowed}. Fix or unset {name}.")
        self.name, self.value = name, value


def _raw(name: str) -> str | None:
    value = os.environ.get(name)
    return None if value is None or not value.strip() else value


_TIMEOUT_ALLOWED = (f"a number of seconds > 0 and <= {MAX_TIMEOUT_S:g} (a week); 0, negative, "
                    "nan and inf are refused because every wait must end")
_timeout_override: float | None = None  # install(timeout_s=...)


def timeout_s() -> float:
    """How long one wait may block: install()'s timeout_s, else MEGATRON_OVERLAP_TIMEOUT_S
    (checked), else 300 s."""
    return _timeout_override if _timeout_override is not None else _timeout_env()


def _timeout_env() -> float:
    raw = _raw(TIMEOUT_S)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise EnvError(TIMEOUT_S, raw, _TIMEOUT_ALLOWED) from None
    if not _usable_timeout(value):
        raise EnvError(TIMEOUT_S, raw, _TIMEOUT_ALLOWED)
    return value


def _usable_timeout(value: float) -> bool:
    return math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S


def checked_timeout_s(seconds: float) -> float:
    """`seconds` as a timeout (float), or ValueError saying what is allowed."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) \
            or not _usable_timeout(float(seconds)):
        raise ValueError(f"megatron_overlap: timeout_s must be {_TIMEOUT_ALLOWED}; "
                         f"not {seconds!r}")
    return float(seconds)


def set_timeout_s(seconds: float | None) -> float | None:
    """Override the variable (None restores it); returns the previous override. Read by
    every bounded wait that starts later, and by transports made later (a transport
    keeps the timeout it was made with: they are made at a layer's first forward)."""
    global _timeout_override
    previous = _timeout_override
    _timeout_override = None if seconds is None else checked_timeout_s(seconds)
    return previous


def _int(name: str, default: int, lo: int, hi: int | None) -> int:
    raw = _raw(name)
    if raw is None:
        return default
    allowed = f"an integer >= {lo}" + (f" and <= {hi}" if hi is not None else "")
    try:
        value = int(raw.strip())
    except ValueError:
        raise EnvError(name, raw, allowed) from None
    if value < lo or (hi is not None and value > hi):
        raise EnvError(name, raw, allowed)
    return value


def gemm_streams() -> int:
    """MEGATRON_OVERLAP_GEMM_STREAMS (default DEFAULT_GEMM_STREAMS): streams the chunk GEMMs
    round-robin over."""
    return _int(GEMM_STREAMS, DEFAULT_GEMM_STREAMS, 1, MAX_GEMM_STREAMS)


def inter_backend() -> str:
    """MEGATRON_OVERLAP_INTER_BACKEND (default torch_p2p): transport between P2P domains."""
    raw = _raw(INTER_BACKEND)
    if raw is None:
        return "torch_p2p"
    if raw.strip() not in INTER_BACKENDS:
        raise EnvError(INTER_BACKEND, raw, " | ".join(INTER_BACKENDS))
    return raw.strip()


def graphs() -> bool:
    """MEGATRON_OVERLAP_GRAPHS (default on): capture each layer pass once and replay it."""
    raw = _raw(GRAPHS)
    if raw is None:
        return True
    value = raw.strip().lower()
    if value in ("1", "true", "on", "yes"):
        return True
    if value in ("0", "false", "off", "no"):
        return False
    raise EnvError(GRAPHS, raw, "1 or 0 (true/false, on/off, yes/no)")


def local_world_size() -> int | None:
    """LOCAL_WORLD_SIZE (torchrun's ranks per node), or None when unset."""
    if _raw(LOCAL_WORLD_SIZE) is None:
        return None
    return _int(LOCAL_WORLD_SIZE, 0, 1, None)


def check_all() -> None:
    """Read every variable once: install() calls it so a bad value fails there, not at
    the first forward."""
    _timeout_env()
    gemm_streams()
    inter_backend()
    graphs()
    local_world_size()
