"""DESIGN.md's reference layer shapes, and shrinking them for small machines.

M is the token count (sequence x micro-batch, gathered over the TP group), K and
N the per-rank GEMM sizes: AG->GEMM multiplies the gathered [M, K] input by this
rank's [N, K] weight; GEMM->RS multiplies this rank's [M, K] input by its [N, K]
weight and reduce-scatters the [M, N] partial sums over rows.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


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


REFERENCE: tuple[Shape, ...] = (
    Shape("70B_tp8_qkv", 8192, 8192, 1280, "ag", 8),
    Shape("70B_tp8_fc1", 8192, 8192, 7168, "ag", 8),
    Shape("70B_tp8_proj", 8192, 1024, 8192, "rs", 8),
    Shape("70B_tp8_fc2", 8192, 3584, 8192, "rs", 8),
    Shape("8B_tp4_fc1", 8192, 4096, 7168, "ag", 4),
    Shape("8B_tp4_fc2", 8192, 3584, 4096, "rs", 4),
    Shape("8B_tp2_qkv", 4096, 4096, 3072, "ag", 2),
)
# Short sequences, where the host's share is largest: 70B (hidden 8192, ffn 28672,
# 64 heads, 8 KV groups, SwiGLU) and 8B (4096, 14336, 32 heads, 8 KV groups) at TP=8.
SHORT: tuple[Shape, ...] = tuple(
    Shape(f"{model}_tp8_{layer}_{m}", m, k, n, op, 8)
    for model, m, dims in (("70B", 2048, (8192, 1280, 7168, 1024, 3584, 8192)),
                           ("70B", 4096, (8192, 1280, 7168, 1024, 3584, 8192)),
                           ("8B", 4096, (4096, 768, 3584, 512, 1792, 4096)))
    for layer, k, n, op in (("qkv", dims[0], dims[1], "ag"), ("fc1", dims[0], dims[2], "ag"),
                            ("proj", dims[3], dims[5], "rs"), ("fc2", dims[4], dims[5], "rs")))
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
