"""The benchmarks' layer shapes (DESIGN.md's reference shapes and short-sequence
ones, both derived from `simulate.shapes`), and shrinking them for small machines.

M is the token count (sequence x micro-batch, gathered over the TP group), K and
N the per-rank GEMM sizes: AG->GEMM multiplies the gathered [M, K] input by this
rank's [N, K] weight; GEMM->RS multiplies this rank's [M, K] input by its [N, K]
weight and reduce-scatters the [M, N] partial sums over rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config.names import COLUMN_BUFFERS, ROW_BUFFERS
from ..simulate import shapes as sim


@dataclass(frozen=True)
class Shape:
    name: str
    m: int
    k: int
    n: int
    op: str  # "ag" (AG->GEMM) | "rs" (GEMM->RS)
    tp: int  # the TP size the shape comes from (its per-rank K / N assume it)

    @property
    def flops(self) -> int:
        """Per-rank GEMM FLOPs of one call."""
        return 2 * self.m * self.k * self.n


def _of(s: "sim.Shape", name: str | None = None) -> Shape:
    return Shape(name or s.name, s.m, s.k, s.n, "ag" if s.column else "rs", s.tp)


# DESIGN.md's reference shapes, kept once in simulate.shapes.
REFERENCE: tuple[Shape, ...] = tuple(_of(s) for s in sim.REFERENCE.values())
# Short sequences, where the host's share is largest: the 70B and 8B presets at TP=8.
ORDER = COLUMN_BUFFERS + ROW_BUFFERS  # qkv, fc1, proj, fc2
SHORT: tuple[Shape, ...] = tuple(
    _of(s, f"{s.model}_tp8_{s.buffer}_{seq}")
    for model, seq in (("70b", 2048), ("70b", 4096), ("8b", 4096))
    for s in sorted(replace(sim.PRESETS[model], seq_length=seq, micro_batch=1)
                    .shapes(model.upper(), 8), key=lambda s: ORDER.index(s.buffer)))
BY_NAME = {s.name: s for s in REFERENCE + SHORT}


def parse(spec: str) -> list[Shape]:
    """'all' (the reference shapes), 'short', or a comma list of reference and short
    names and custom NAME:M:K:N:OP[:TP] entries."""
    if spec in ("", "all"):
        return list(REFERENCE)
    if spec == "short":
        return list(SHORT)
    out = []
    for item in spec.split(","):
        item = item.strip()
        if item in BY_NAME:
            out.append(BY_NAME[item])
            continue
        parts = item.split(":")
        if len(parts) not in (5, 6) or parts[4] not in ("ag", "rs"):
            raise SystemExit(f"unknown shape {item!r}: use one of {sorted(BY_NAME)} or "
                             f"NAME:M:K:N:ag|rs[:TP]")
        m, k, n = (int(p) for p in parts[1:4])
        out.append(Shape(parts[0], m, k, n, parts[4], int(parts[5]) if len(parts) == 6 else 0))
    return out


def scaled(shape: Shape, tp: int, m_div: int = 1, kn_div: int = 1, align: int = 8) -> Shape:
    """Shrink M by m_div and K, N by kn_div (for CPUs), keeping M a multiple of
    tp * align so every row split (TP blocks, pipeline chunks up to `align`) divides."""
    unit = tp * align
    m = max(unit, shape.m // m_div // unit * unit)
    return replace(shape, m=m, k=max(8, shape.k // kn_div), n=max(8, shape.n // kn_div))
