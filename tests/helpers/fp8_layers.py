"""Our layers in FP8 against the independent FP8 reference (helpers/fp8_ref.py): every
rank builds the whole input, weight and upstream gradient, gives the layer its shard,
and computes what each output, input grad, weight grad and bias grad must be from the
whole tensors: quantize, then one whole-tensor _scaled_mm (the ranks' partial products
summed in fp64 where the layer reduces)."""

from __future__ import annotations

import functools
import itertools
from dataclasses import asdict, dataclass

import torch

from helpers import fp8_ref as ref
from helpers.layers import VARIANTS

K_COL, N_COL = 32, 64  # column: input_size, output_size (per rank N / TP: 32 or 16)
SEQ, BATCH = 8, 2  # per rank under SP: 16 token rows, a multiple of 16
COLUMN_VARIANTS = ("ring", "ring_aggregate", "no_bulk_bwd", "rs_dgrad_pipeline2", "rs_dgrad_ring",
                   "ag_off")
ROW_VARIANTS = ("pipeline1", "pipeline2", "ring", "ring_dgrad_aggregate", "rs_off")


@dataclass(frozen=True)
class Fp8Case:
    kind: str  # column | row
    variant: str  # helpers.layers.VARIANTS
    sp: bool
    dtype: str  # the params' (and the GEMM outputs')
    fp8: str = "hybrid"
    fp8_wgrad: bool = True
    main_grad: bool = False  # gradient_accumulation_fusion: dW accumulated into an fp32 main_grad
    scaling: str = "tensorwise"  # install(fp8_scaling=...): rowwise runs fp8_wgrad=False only

    @property
    def id(self) -> str:
        return "-".join(f"{k}={v}" for k, v in asdict(self).items())


def per_peer_cases() -> list[Fp8Case]:
    """The cases whose passes run rings: on TP 4 over 2 emulated nodes they run the
    hierarchical orders through per-peer transports."""
    return [Fp8Case(kind, v, True, dt) for kind, v in (
        ("column", "ring"), ("column", "rs_dgrad_ring"), ("column", "rs_dgrad_pipeline2"),
        ("row", "pipeline2"), ("row", "ring"))
        for dt in ("bfloat16", "float32")]


def cases() -> list[Fp8Case]:
    out = [Fp8Case(kind, v, sp, dt) for kind, vs in (("column", COLUMN_VARIANTS),
                                                      ("row", ROW_VARIANTS))
           for v, sp, dt in itertools.product(vs, (True, False), ("bfloat16", "float32"))]
    for kind, v in (("column", "ring"), ("row", "pipeline2")):
        for sp in (True, False):
            out += [Fp8Case(kind, v, sp, "bfloat16", fp8="e4m3"),
                    Fp8Case(kind, v, sp, "bfloat16", fp8_wgrad=False),
                    Fp8Case(kind, v, sp, "bfloat16", main_grad=True),
                    Fp8Case(kind, v, sp, "bfloat16", fp8_wgrad=False, main_grad=True)]
    return out


def rowwise_cases() -> list[Fp8Case]:
    """Row-wise scaling: every variant, SP on and off, in bf16 (its GEMM outputs bf16
    only) with the wgrad in bf16 (fp8_wgrad=False); e4m3 grads and main_grad on two."""
    rw = dict(dtype="bfloat16", fp8_wgrad=False, scaling="rowwise")
    out = [Fp8Case(kind, v, sp, **rw) for kind, vs in (("column", COLUMN_VARIANTS),
                                                        ("row", ROW_VARIANTS))
           for v, sp in itertools.product(vs, (True, False))]
    for kind, v in (("column", "ring"), ("row", "pipeline2")):
        for sp in (True, False):
            out += [Fp8Case(kind, v, sp, fp8="e4m3", **rw), Fp8Case(kind, v, sp, main_grad=True, **rw)]
    return out


def config(tp: int, sp: bool, dtype: torch.dtype, flags: dict | None = None, **fp8):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=K_COL, num_attention_heads=4,
                             tensor_model_parallel_size=tp, sequence_parallel=sp,
                             tp_comm_overlap=True, use_cpu_initialization=True,
                             params_dtype=dtype, **(flags or {}), **fp8)


def build(kind: str, cfg, bias: bool = True):
    from megatron_overlap.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear

    init = lambda w: torch.nn.init.zeros_(w)  # noqa: E731  (the test sets every weight)
    if kind == "column":
        return OverlapColumnParallelLinear(K_COL, N_COL, config=cfg, init_method=init, bias=bias,
                                           gather_output=False, tp_comm_buffer_name="qkv")
    return OverlapRowParallelLinear(N_COL, K_COL, config=cfg, init_method=init, bias=bias,
                                    input_is_parallel=True, skip_bias_add=False,
                                    tp_comm_buffer_name="proj")


def first_call(world: int, install: dict, **fp8) -> dict:
    """A column layer (SP, bf16) built under `install(**install)` with these FP8 fields on
    this rank, called once: {'error': the DisagreementError's text or None, 'moved': what
    the transports counted by then}. Ranks built differently must stop there, nothing
    moved."""
    import megatron_overlap as mo
    from helpers.megatron_cpu import init
    from megatron_overlap.comm import stats
    from megatron_overlap.layers.agree import DisagreementError

    init(world)
    mo.install(**install)
    try:
        layer = build("column", config(world, True, torch.bfloat16, **fp8))
    finally:
        mo.uninstall()
    stats.snapshot()
    try:
        layer(torch.randn(8, 2, 32, dtype=torch.bfloat16))
        return {"error": None}
    except DisagreementError as exc:
        return {"error": str(exc), "moved": stats.snapshot()}


def rows_and_moved(pairs: dict, world: int) -> dict:
    """One forward + backward of each built layer pair ({precision: {"column": layer, "row":
    layer}}, SP, TP `world`, hidden 32): each layer's settings rows as (buffer bytes,
    precision) per pass ('rows_<p>_<kind>'), and the bytes each op moved ('moved_<p>')."""
    from megatron_overlap.comm import stats

    out = {}
    for p, pair in pairs.items():
        stats.snapshot()
        for k, layer in pair.items():
            x = torch.randn(8 if k == "column" else 8 * world, 2, 32, dtype=torch.bfloat16,
                            requires_grad=True)
            y, _ = layer(x)
            y.float().sum().backward()
            out[f"rows_{p}_{k}"] = {r["pass"]: (r["buffer_bytes"], r["precision"])
                                    for r in layer.overlap_rows()}
        out[f"moved_{p}"] = {op: s["bytes"] for op, s in stats.snapshot().items()}
    return out


def step_with(layer, x: torch.Tensor, dy: torch.Tensor, values) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward + backward of `layer` on fixed buffers `x`, `dy` filled with `values`
    (weight, bias, input, output grad), as a replayed pass needs (new values, the same
    addresses); returns (output, input leaf)."""
    with torch.no_grad():
        layer.weight.copy_(values[0])
        layer.bias.copy_(values[1])
    x.copy_(values[2])
    dy.copy_(values[3])
    xi = x.detach().requires_grad_(True)
    layer.weight.grad = layer.bias.grad = None
    y, _ = layer(xi)
    y.backward(dy)
    return y, xi


def _whole(case: Fp8Case, tp: int, dtype: torch.dtype, seed: int = 0):
    """The whole weight, bias, input and upstream gradient (every rank the same)."""
    g = torch.Generator().manual_seed(seed)
    seq = SEQ * tp if case.sp else SEQ
    if case.kind == "column":
        w = torch.randn(N_COL, K_COL, generator=g)
        b = torch.randn(N_COL, generator=g)
        x = torch.randn(seq, BATCH, K_COL, generator=g) * 3
        dy = torch.randn(seq, BATCH, N_COL, generator=g)
    else:
        w = torch.randn(K_COL, N_COL, generator=g)
        b = torch.randn(K_COL, generator=g)
        x = torch.randn(seq, BATCH, N_COL, generator=g) * 3
        dy = torch.randn(seq, BATCH, K_COL, generator=g)
    return tuple(t.to(dtype) for t in (w, b, x, dy))


def _shards(case: Fp8Case, rank: int, tp: int, w, b, x, dy):
    """This rank's weight, bias, input and upstream gradient."""
    if case.kind == "column":
        x_r = x.chunk(tp)[rank] if case.sp else x
        return w.chunk(tp)[rank], b.chunk(tp)[rank], x_r, dy.chunk(tp, dim=-1)[rank]
    dy_r = dy.chunk(tp)[rank] if case.sp else dy
    return w.chunk(tp, dim=1)[rank], b, x.chunk(tp, dim=-1)[rank], dy_r


def reference(case: Fp8Case, rank: int, tp: int, w, b, x, dy, scales: dict | None = None
              ) -> dict[str, torch.Tensor]:
    """What this rank's output, input grad, weight grad and bias grad must be. `scales`
    (delayed scaling): {'input', 'weight', 'grad': the scale every rank quantizes that
    tensor with}; else each tensor's own (current scaling)."""
    if case.scaling == "rowwise":
        return rowwise_reference(case, rank, tp, w, b, x, dy)
    def quantize(t: torch.Tensor, dt: torch.dtype, role: str):
        return ref.quantize(t, dt, None if scales is None else scales[role])

    dtype = w.dtype
    wdt = torch.float32 if case.main_grad else dtype  # what the wgrad GEMM outputs
    grad8 = ref.E5M2 if case.fp8 == "hybrid" else ref.E4M3
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    mine = lambda t: t.chunk(tp)[rank] if case.sp else t  # noqa: E731  (SP: this rank's rows)
    if case.kind == "column":
        x8, sx = quantize(flat(x), ref.E4M3, "input")  # the whole (gathered) input: one scale
        out, dgrad_parts = None, []
        for q in range(tp):
            w8, sw = quantize(w.chunk(tp)[q], ref.E4M3, "weight")
            g_q = flat(dy.chunk(tp, dim=-1)[q])
            g8, sg = quantize(g_q, grad8, "grad")  # a column rank's gradient: its own scale
            dgrad_parts.append(ref.mm(g8, sg, w8, sw, dtype).double())
            if q == rank:
                out = ref.mm(x8, sx, w8.t(), sw, dtype)
                out.add_(b.chunk(tp)[q])
                if case.fp8_wgrad:
                    wgrad = ref.mm(g8.t(), sg, x8, sx, wdt)
                else:
                    wgrad = torch.mm(g_q.t().to(wdt), flat(x).to(wdt))
                bgrad = g_q.sum(0)
        return {"output": out, "input_grad": mine(sum(dgrad_parts)),
                "weight_grad": wgrad, "bias_grad": bgrad}
    g8, sg = quantize(flat(dy), grad8, "grad")  # the whole (gathered) gradient: one scale
    parts = []
    for q in range(tp):
        xq8, sxq = quantize(flat(x.chunk(tp, dim=-1)[q]), ref.E4M3, "input")  # a row rank's own
        wq8, swq = quantize(w.chunk(tp, dim=1)[q], ref.E4M3, "weight")
        parts.append(ref.mm(xq8, sxq, wq8.t(), swq, dtype).double())
        if q == rank:
            dgrad = ref.mm(g8, sg, wq8, swq, dtype)
            if case.fp8_wgrad:
                wgrad = ref.mm(g8.t(), sg, xq8, sxq, wdt)
            else:
                wgrad = torch.mm(ref.dequantize(g8, sg, dtype).t().to(wdt),
                                 flat(x.chunk(tp, dim=-1)[q]).to(wdt))
    return {"output": mine(sum(parts)) + b.double(), "input_grad": dgrad, "weight_grad": wgrad,
            "bias_grad": flat(mine(dy)).sum(0)}


def rowwise_reference(case: Fp8Case, rank: int, tp: int, w, b, x, dy) -> dict[str, torch.Tensor]:
    """Row-wise: each GEMM's first operand scaled per row, its second per output column
    (the weight per row of W forward, per column of W for the dgrad); the wgrad in the
    params' dtype (the row layer's on the gathered FP8 gradient dequantized)."""
    dtype = w.dtype
    wdt = torch.float32 if case.main_grad else dtype
    grad8 = ref.E5M2 if case.fp8 == "hybrid" else ref.E4M3
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    mine = lambda t: t.chunk(tp)[rank] if case.sp else t  # noqa: E731
    rows = lambda t, dt=ref.E4M3: ref.quantize_axis(t, dt, 1)  # noqa: E731
    cols = lambda t: ref.quantize_axis(t, ref.E4M3, 0)  # noqa: E731
    if case.kind == "column":
        x8, sx = rows(flat(x))
        out, dgrad_parts = None, []
        for q in range(tp):
            w_q, g_q = w.chunk(tp)[q], flat(dy.chunk(tp, dim=-1)[q])
            g8, sg = rows(g_q, grad8)
            wc8, swc = cols(w_q)
            dgrad_parts.append(ref.mm(g8, sg, wc8, swc, dtype).double())
            if q == rank:
                w8, sw = rows(w_q)
                out = ref.mm(x8, sx, w8.t(), sw.t(), dtype).add_(b.chunk(tp)[q])
                wgrad = torch.mm(g_q.t().to(wdt), flat(x).to(wdt))
                bgrad = g_q.sum(0)
        return {"output": out, "input_grad": mine(sum(dgrad_parts)),
                "weight_grad": wgrad, "bias_grad": bgrad}
    g8, sg = rows(flat(dy), grad8)
    parts = []
    for q in range(tp):
        x_q, w_q = flat(x.chunk(tp, dim=-1)[q]), w.chunk(tp, dim=1)[q]
        xq8, sxq = rows(x_q)
        wq8, swq = rows(w_q)
        parts.append(ref.mm(xq8, sxq, wq8.t(), swq.t(), dtype).double())
        if q == rank:
            wc8, swc = cols(w_q)
            dgrad = ref.mm(g8, sg, wc8, swc, dtype)
            wgrad = torch.mm(ref.dequantize(g8, sg, dtype).t().to(wdt), x_q.to(wdt))
    return {"output": mine(sum(parts)) + b.double(), "input_grad": dgrad, "weight_grad": wgrad,
            "bias_grad": flat(mine(dy)).sum(0)}


@functools.cache
def _cpu_rowwise() -> bool:
    """Whether this torch's CPU `_scaled_mm` takes row-wise scales (2.13 does, 2.11 not)."""
    a = torch.ones(16, 16).to(ref.E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16),
                         out_dtype=torch.bfloat16)
    except RuntimeError:
        return False
    return True


def one_step(layer, case: Fp8Case, rank: int, tp: int, whole, device: str = "cpu",
             set_weights: bool = True) -> dict:
    """One forward + backward of `layer` given this rank's shards of `whole` (weight, bias,
    input, upstream gradient; the weight and bias left as they are without `set_weights`,
    as at a step's later micro-batch): its output, input grad, weight grad (main_grad's,
    from zero, with `case.main_grad`) and bias grad, on the CPU."""
    w_r, b_r, x_r, dy_r = (t.to(device) for t in _shards(case, rank, tp, *whole))
    if set_weights:
        with torch.no_grad():
            layer.weight.copy_(w_r)
            layer.bias.copy_(b_r)
    layer.weight.grad = layer.bias.grad = None
    if case.main_grad:
        layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32, device=device)
    xi = x_r.clone().requires_grad_(True)
    y, _ = layer(xi)
    y.backward(dy_r)
    got = {"output": y.detach().reshape(-1, y.shape[-1]), "input_grad": xi.grad,
           "weight_grad": layer.weight.main_grad if case.main_grad else layer.weight.grad,
           "bias_grad": layer.bias.grad}
    return {k: v.cpu() for k, v in got.items()}


def run_case(case: Fp8Case, rank: int, tp: int, device: str = "cpu") -> dict:
    """The case's layer on this rank against the reference (computed on CPU, a row-wise one
    on `device` where this torch's CPU has no row-wise `_scaled_mm`); `device`: where the
    layer runs (tests/gpu/test_fp8_gpu.py: "cuda")."""
    import megatron_overlap as mo

    dtype = getattr(torch, case.dtype)
    overrides, flags = VARIANTS[case.kind][case.variant]
    mo.install(ub_cfgs=overrides, fp8_scaling=case.scaling)
    try:
        layer = build(case.kind, config(tp, case.sp, dtype, flags, fp8=case.fp8,
                                        fp8_recipe="tensorwise", fp8_wgrad=case.fp8_wgrad,
                                        gradient_accumulation_fusion=case.main_grad))
    finally:
        mo.uninstall()
    layer = layer.to(device)
    whole = _whole(case, tp, dtype)
    got = one_step(layer, case, rank, tp, whole, device)
    # torch before 2.13 runs only per-tensor scales in a CPU `_scaled_mm`: there a row-wise
    # reference runs where the layer ran (the GPU's own row-wise kernel, not the schedules)
    ref_device = device if case.scaling == "rowwise" and not _cpu_rowwise() else "cpu"
    want = {k: v.cpu() for k, v in reference(case, rank, tp, *(t.to(ref_device) for t in whole)).items()}
    out = {"megatron_forward": layer._use_megatron, "precision": layer.precision.describe(),
           "transport": layer.transport.name,
           "orders": {p: o.label for p, o in layer.ring_orders.items()}}
    for k, v in got.items():
        v, r = v.reshape(want[k].shape), want[k]
        want_dtype = torch.float32 if case.main_grad and k == "weight_grad" else dtype
        out[k] = {"dtype": v.dtype == want_dtype, "equal": torch.equal(v, r.to(v.dtype)),
                  "rel": ref.rel(v, r)}
    return out


def run_cases(rank: int, world: int, cases_: list[Fp8Case]) -> dict:
    from helpers.megatron_cpu import init

    init(world)
    return {c.id: run_case(c, rank, world) for c in cases_}
