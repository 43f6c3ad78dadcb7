"""The memory-bound FP8 work of a pass around its GEMM, as the layers run it
(layers/fp8.py, layers/functions.py, overlap/fp8.py): amaxes, scales, casts, transposed
copies and the row-wise GEMMs' reciprocal scales, in bytes read + written and kernels. A
pass's GEMM and transfers are the schedules'; this is the rest, which an FP8 pass pays
and a bf16 pass does not, on the GEMMs' stream before or after them.

Per pass, with T tokens, TP size W, per-rank K (in) and N (out), p the parameters' bytes
per element, under sequence parallelism (what the overlapped passes run; without it
nothing is gathered, so the casts write every wgrad layout and the wgrad transposes
nothing, which this table does not model):

| pass | column layer (input gathered) | row layer (output reduce-scattered) |
|---|---|---|
| fprop | its input block [T/W, K]; the weight [N, K] | its input [T, K]; the weight |
| dgrad | the output gradient [T, N] | its block of the gradient [T/W, N] |
| wgrad | a transposed copy of the gathered input [T, K] (fp8_wgrad), the product added into main_grad | a transposed copy of the gathered gradient [T, N]; without fp8_wgrad the gathered gradient dequantized |

- Tensorwise (`quantize_current`): the amax read (a gathered tensor's: the TP group's,
  exchanged), then one cast kernel that makes its scale from the amax (the max of the
  group's) and writes the scale pair (the scaled GEMM launches nothing of its own). A
  tensor that an FP8 GEMM reads
  transposed and that is not gathered (the weight, for the dgrad; with fp8_wgrad a row
  layer's input and a column layer's gradient, for the wgrad) is cast into both layouts
  by one kernel (`quantize(..., out_t=)`: overlap/fp8_kernels.py's cast-transpose, the
  wide tensor read once); a gathered one is transposed in the wgrad (a `transpose` of its
  FP8 values).
- Delayed (`delayed_quantize`): the amax scalar zeroed, then one kernel that casts with
  the history's scale, reduces the amax and copies the scale pair for the GEMMs (and writes
  the transposed layout where the tensorwise cast would): the wide tensor read once, no
  scale kernel, no exchange before a gather. At the end of the pass the amaxes it took
  (`DELAYED_AMAXES`: the input's and the weight's place; the gradient's) are exchanged
  over the TP group, and one kernel takes the group's max and updates the pass's
  histories (`overlap.fp8.update_scales`). The histories' bytes (8 a kept amax) are left
  out with the scalars.
- The amax counts as one kernel; on a GPU it also launches a memset (tensorwise: the
  Triton amax's scalar zeroed, as torch's reduction also does).
- Row-wise: the amax along each row (torchao: |x| written, then reduced) and eight small
  kernels on the [rows, 1] scales (power-of-two rounding), the cast eagerly (upcast,
  multiply, clamp, cast, copy: `EAGER_CAST` bytes an element beyond p), the scales copied
  into the rows' tails; the weight per row for the forward and again per column, from the
  parameters, for the dgrad; one reciprocal for the weight's scales and one per GEMM call
  for the rows'; the wgrad in the parameters' dtype.
- A pipelined reduce-scatter's FP8 chunks copy their rows together (`batched`).
- An FP8 wgrad accumulating into an fp32 `main_grad` (Megatron's
  gradient_accumulation_fusion, on by default in Megatron-LM; `accumulates`) writes its
  product, then adds it: 12 bytes an element, one kernel. (A bf16 wgrad accumulates in
  apex's fused GEMM where apex is installed.)

The tensorwise weight's part (`PassWork.weight`) runs at a step's first micro-batch only
where Megatron's schedules drive the layer's FP8 weight cache (`layers.fp8.Fp8WeightCache`;
`weight_cached`), so the step estimate counts it once per step; row-wise, at every
forward. tests/test_fp8_work.py holds this table to the operations the layers issue
(benchmarks/layer_ledger.py's dispatch mode), pass by pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Hardware

TENSORWISE_KERNELS = 2  # amax, the cast making its scale (overlap.fp8.quantize_current)
DELAYED_KERNELS = 2  # the amax zeroed, the cast reducing it (overlap/fp8_kernels.py)
DELAYED_AMAXES = {"fprop": 2, "dgrad": 1}  # a pass's amaxes exchanged at its end (delayed)
ROW_SCALE_KERNELS = 10  # |x|, its amax along the row, eight on the [rows, 1] scales
ROW_SCALE_BYTES = 100  # bytes per row of those eight and of the amax's output
EAGER_CAST = (5, 27)  # kernels; bytes an element beyond p: fp32 upcast, multiply, clamp, cast, copy
DEQUANT = (3, 17)  # (g8.float() / scale).to(p): kernels; bytes an element beyond p
ACCUMULATE = 12  # main_grad.add_(fp32 product): bytes an element (two fp32 reads, a write)


@dataclass(frozen=True)
class Work:
    """Memory-bound work: bytes read + written, kernels launched."""

    bytes: int = 0
    kernels: int = 0

    def __add__(self, other: "Work") -> "Work":
        return Work(self.bytes + other.bytes, self.kernels + other.kernels)

    def us(self, hw: Hardware) -> float:
        """At the HBM bandwidth, each kernel `hw.kernel_us` (launch gap, prologue, tail)."""
        return self.bytes / (hw.hbm_gbs * 1e3) + self.kernels * hw.kernel_us


@dataclass(frozen=True)
class PassWork:
    activations: Work = Work()  # at every micro-batch
    weight: Work = Work()  # at a step's first micro-batch (the FP8 weight cache)

    @property
    def total(self) -> Work:
        return self.activations + self.weight


def quantize(elems: int, p: int, scaling: str = "tensorwise", rows: int = 0,
             scales_out: bool = True, col: bool = False) -> Work:
    """One tensor of `elems` elements (`rows` rows) in p-byte precision made FP8 with its
    scale(s) (`scaling`: 'tensorwise', 'delayed' or 'rowwise'); `col` (per tensor): its
    transposed layout written by the same cast. Row-wise: |x| written and read, the amax,
    the eager cast, and with `scales_out` the scales copied out (into the rows' tails, or
    the weight's scale tensor: 4 bytes read and written a row)."""
    if scaling == "rowwise":
        copy = Work(8 * rows, 1) if scales_out else Work()
        return Work((3 * p + p + EAGER_CAST[1]) * elems + ROW_SCALE_BYTES * rows,
                    ROW_SCALE_KERNELS + EAGER_CAST[0]) + copy
    written = 2 if col else 1  # FP8 bytes an element: with `col` both layouts, one kernel
    if scaling == "delayed":  # the amax reduced in the cast's kernel: x read once
        return Work((p + written) * elems, DELAYED_KERNELS)
    return Work(p * elems + (p + written) * elems, TENSORWISE_KERNELS)


def delayed_record() -> Work:
    """Delayed scaling at a quantizing pass's end: one kernel takes the group's max of the
    pass's amaxes (exchanged before it) and updates its histories, the input's and the
    weight's together."""
    return Work(0, 1)


def gathered(pass_name: str, column: bool) -> bool:
    """Whether the tensor the pass quantizes is gathered: a column forward's input, a row
    dgrad's gradient (one scale over the TP group: tensorwise exchanges its amax first)."""
    return (pass_name, column) in (("fprop", True), ("dgrad", False))


def transpose(elems: int) -> Work:
    """An FP8 tensor's transposed copy (one byte read and written an element)."""
    return Work(2 * elems, 1)


def batched(rows: int, row_bytes: int, chunks: int) -> Work:
    """A pipelined reduce-scatter's FP8 chunks, each one GEMM over every rank's rows
    (`overlap.fp8.batched`): the strided rows copied together, `chunks` copies."""
    return Work(2 * rows * row_bytes, chunks)


def pass_work(pass_name: str, column: bool, tokens: int, tp: int, k: int, n: int,
              p: int, scaling: str = "tensorwise", fp8_wgrad: bool = True,
              gemm_calls: int = 1, accumulates: bool = True,
              weight_cached: bool = True) -> PassWork:
    """The FP8 work of one pass of a linear whose forward GEMM is [tokens(/tp), k] x [k, n]
    per rank (sequence parallel: a column layer's input and a row layer's output split
    over `tp`), its FP8 GEMM issued as `gemm_calls` calls; beyond what its schedule adds
    (`batched`). `scaling`: 'tensorwise', 'delayed' or 'rowwise'; `accumulates`: the wgrad
    adds into an fp32 main_grad; `weight_cached`: the per-tensor FP8 weight is made once
    per step (else at every forward)."""
    rowwise, delayed = scaling == "rowwise", scaling == "delayed"
    gemm = Work(0, 1 + gemm_calls) if rowwise else Work()  # (per tensor: scale pairs)
    cached = weight_cached and not rowwise
    own_t = fp8_wgrad and not rowwise  # the wgrad's layout of an operand not gathered
    if pass_name == "fprop":
        rows = tokens // tp if column else tokens
        act = quantize(rows * k, p, scaling, rows, col=own_t and not column) + gemm
        weight = quantize(n * k, p, scaling, n, col=not rowwise)  # with the dgrad's layout
        if delayed:  # the pass's update (the weight's history with the input's, where quantized)
            act += delayed_record()
        return PassWork(act, weight) if cached else PassWork(act + weight)
    if pass_name == "dgrad":
        rows = tokens if column else tokens // tp
        act = (quantize(rows * n, p, scaling, rows, col=own_t and column) + gemm
               + (delayed_record() if delayed else Work()))
        if rowwise:  # the weight again, per column (its copy out transposes it); no tails
            act += quantize(n * k, p, "rowwise", k, scales_out=False)
        return PassWork(act)
    if pass_name == "wgrad":
        if rowwise or not fp8_wgrad:  # in p: only a row layer's gathered gradient, dequantized
            return PassWork(Work(0, 0) if column else
                            Work(tokens * n * (p + DEQUANT[1]) + (4 * tokens if rowwise else 0),
                                 DEQUANT[0]))
        add = Work(ACCUMULATE * n * k, 1) if accumulates else Work()
        return PassWork(transpose(tokens * (k if column else n)) + gemm + add)
    raise ValueError(f"pass {pass_name!r}: fprop, dgrad or wgrad")
