"""The TP linears' GEMM shapes: DESIGN.md's reference shapes, model presets, and
custom ones, each as (tokens M, per-rank K, per-rank N) of the forward GEMM.

qkv/fc1 are column-parallel (input all-gathered, N split over TP); proj/fc2 are
row-parallel (K split over TP, output reduce-scattered). A shape measured at one
TP size is re-cut for another by scaling its split dimension, which is how the
same model's layers look at that TP.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..config.names import BUFFER_NAMES as BUFFERS
from ..config.names import COLUMN_BUFFERS as COLUMN
from .numerics import BF16, Numerics


# The operand layout of each pass's GEMM [m, k] x [k, n] (`PassSpec.gemm`, `gemm_layout`),
# as the layer's functions (layers/functions.py) hand the operands to matmul: one letter per
# operand, A then B. N: stored as it is multiplied (A a contiguous [m, k], B a contiguous
# [k, n]); T: a transposed view of a contiguous tensor (A = [k, m].t(), B = [n, k].t()).
# cuBLAS may pick another kernel per layout, so a measured GEMM time is kept as one layout's
# (`tune.measure.gemm_operands` builds them; calibrations key by (m, k, n, layout)). On the
# H200 the fc1-size GEMM ran NT, NN and TN within its own run-to-run spread (docs/results.md,
# benchmarks/gemm_drift.py).
GEMM_LAYOUTS = {
    "fprop": "NT",  # x @ weight.t(): weight [n, k]
    "dgrad": "NN",  # g @ weight: weight [k, n] for this GEMM
    "wgrad": "TN",  # g.t() @ x: g a contiguous [k, m]
}


def check_gemm_layout(layout: object) -> str:
    """`layout` if it is an operand layout (two letters, each N or T), else ValueError."""
    if not (isinstance(layout, str) and len(layout) == 2 and set(layout) <= {"N", "T"}):
        raise ValueError(f"GEMM operand layout {layout!r}: expected two letters, each N or T "
                         "(A then B; e.g. NT, the forward pass's x @ weight.t())")
    return layout


@dataclass(frozen=True)
class Shape:
    """One TP linear: forward GEMM [m, k] x [k, n] per rank at TP size `tp`."""

    model: str
    buffer: str  # qkv | proj | fc1 | fc2
    m: int
    k: int
    n: int
    tp: int
    source: str = ""  # where the shape came from (reference name, preset, custom)
    numerics: Numerics = BF16  # what its passes compute and move in

    def __post_init__(self) -> None:
        if self.buffer not in BUFFERS:
            raise ValueError(f"shape {self.model}_{self.buffer}: buffer must be one of {BUFFERS}")
        if min(self.m, self.k, self.n, self.tp) < 1:
            raise ValueError(f"shape {self.name}: dimensions must be >= 1")
        if isinstance(self.numerics, dict):  # read back from a JSON (dataclasses.asdict)
            # (written before fast accumulation was chosen: none was)
            object.__setattr__(self, "numerics", Numerics(**{"fast_accum": "none",
                                                             **self.numerics}))

    @property
    def name(self) -> str:
        return f"{self.model}_tp{self.tp}_{self.buffer}"

    @property
    def column(self) -> bool:
        return self.buffer in COLUMN

    def at_tp(self, tp: int) -> "Shape":
        """The same layer at another TP size: the split dimension scales by self.tp / tp."""
        if tp == self.tp:
            return self
        full = (self.n if self.column else self.k) * self.tp
        if full % tp:
            raise ValueError(f"{self.name}: its split dimension ({full} in all) does not divide "
                             f"into {tp} ranks")
        per_rank = full // tp
        src = self.source or self.name
        return replace(self, tp=tp, source=f"{src} re-cut to TP={tp}",
                       **({"n": per_rank} if self.column else {"k": per_rank}))


# DESIGN.md's table: tokens (sequence x micro-batch), per-rank K and N at that TP.
REFERENCE: dict[str, Shape] = {s.name: s for s in (
    Shape("70B", "qkv", 8192, 8192, 1280, 8, "reference"),
    Shape("70B", "fc1", 8192, 8192, 7168, 8, "reference"),
    Shape("70B", "proj", 8192, 1024, 8192, 8, "reference"),
    Shape("70B", "fc2", 8192, 3584, 8192, 8, "reference"),
    Shape("8B", "fc1", 8192, 4096, 7168, 4, "reference"),
    Shape("8B", "fc2", 8192, 3584, 4096, 4, "reference"),
    Shape("8B", "qkv", 4096, 4096, 3072, 2, "reference"),
)}


@dataclass(frozen=True)
class ModelDims:
    """What a transformer's four TP linears follow from (Llama-style, SwiGLU MLP)."""

    hidden: int
    ffn_hidden: int
    heads: int
    query_groups: int
    seq_length: int = 8192
    micro_batch: int = 1
    layers: int = 1
    swiglu: bool = True

    def shapes(self, model: str, tp: int, numerics: Numerics = BF16) -> list[Shape]:
        """qkv, proj, fc1, fc2 at TP size `tp` in `numerics` (ValueError where a dimension
        does not split)."""
        head_dim = self.hidden // self.heads
        qkv_out = self.hidden + 2 * self.query_groups * head_dim
        fc1_out = self.ffn_hidden * (2 if self.swiglu else 1)
        for what, size in (("qkv output", qkv_out), ("hidden", self.hidden),
                           ("fc1 output", fc1_out), ("ffn hidden", self.ffn_hidden)):
            if size % tp:
                raise ValueError(f"{model}: {what} {size} does not split over TP={tp}")
        m = self.seq_length * self.micro_batch
        src = f"preset {model}"
        return [Shape(model, "qkv", m, self.hidden, qkv_out // tp, tp, src, numerics),
                Shape(model, "proj", m, self.hidden // tp, self.hidden, tp, src, numerics),
                Shape(model, "fc1", m, self.hidden, fc1_out // tp, tp, src, numerics),
                Shape(model, "fc2", m, self.ffn_hidden // tp, self.hidden, tp, src, numerics)]


PRESETS: dict[str, ModelDims] = {  # Llama 3 dimensions
    "70b": ModelDims(hidden=8192, ffn_hidden=28672, heads=64, query_groups=8, layers=80),
    "8b": ModelDims(hidden=4096, ffn_hidden=14336, heads=32, query_groups=8, layers=32),
}
MODEL_LAYERS = {"70B": 80, "8B": 32}


def parse_shapes(spec: str, tp: int, numerics: Numerics = BF16) -> list[Shape]:
    """Comma-separated: `reference` (DESIGN.md's seven), a reference name
    (`70B_tp8_qkv`), a preset (`70b`, `8b`: its four linears), or a custom
    `MODEL_BUFFER=MxKxN` (per-rank K/N at TP=`tp`). Every shape comes out at TP=`tp`,
    in `numerics`."""
    out: list[Shape] = []
    for token in filter(None, (t.strip() for t in spec.split(","))):
        if token == "reference":
            out += [s.at_tp(tp) for s in REFERENCE.values()]
        elif token in REFERENCE:
            out.append(REFERENCE[token].at_tp(tp))
        elif token.lower() in PRESETS:
            out += PRESETS[token.lower()].shapes(token.upper(), tp)
        elif "=" in token:
            name, _, dims = token.partition("=")
            model, _, buffer = name.rpartition("_")
            try:
                m, k, n = (int(d) for d in dims.lower().split("x"))
            except ValueError:
                raise ValueError(f"shape {token!r}: expected MODEL_BUFFER=MxKxN") from None
            if m % tp:
                raise ValueError(f"shape {token!r}: M={m} tokens do not split over TP={tp} "
                                 "(sequence parallelism gives each rank M / TP rows)")
            out.append(Shape(model or name, buffer, m, k, n, tp, "custom"))
        else:
            raise ValueError(f"shape {token!r}: not `reference`, a reference name "
                             f"({', '.join(REFERENCE)}), a preset ({', '.join(PRESETS)}) "
                             "or MODEL_BUFFER=MxKxN")
    if not out:
        raise ValueError("no shapes given")
    return [replace(s, numerics=numerics) for s in out]
