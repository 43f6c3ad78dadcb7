"""The cost model's FP8 work (megatron_overlap/simulate/fp8_work.py, through
simulate.passes.fp8_work) against what the layers issue. A column or a row layer (SP, TP 2,
bf16 parameters) with a schedule of helpers/layers.py's VARIANTS, in FP8 (tensorwise,
delayed or row-wise, fp8_wgrad on or off, the wgrad into an fp32 main_grad or not), runs forward +
backward under benchmarks/layer_ledger.py's dispatch mode (GEMMs not computed; each
compiled FP8 kernel one operation, as on a GPU), at a step's first micro-batch and at a
later one (Megatron's schedules drive `is_first_microbatch`, so the tensorwise FP8 weight
is made at the first only; delayed scaling's histories are one amax long, Megatron's
default, so their bytes are the scalars'). What the layer's FP8 code issues (its operations in
overlap/fp8.py, layers/fp8.py, and the wgrad's accumulation in layers/wgrad.py) must be
what the model says, pass by pass: the forward's its fprop (first micro-batch: with the
weight's part; later: without), the backward's its dgrad and wgrad. The same kernels; the
same bytes but the 4-byte scalars (per tensor: amaxes, scales, their reciprocals) or,
row-wise, within 1% (the [rows, 1] scales' small kernels, which a row of 64 elements
weighs more than a model's rows). The bf16 layer issues none of it."""

import os
import sys

import pytest
import torch

from helpers import dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K, N, SEQ, BATCH = 64, 128, 32, 2  # hidden, column output (row input); per rank 32 x 2 tokens
SCALARS = 4096  # bytes of 4-byte scalars the model leaves out, at most, per pass
FP8_SITES = ("overlap/fp8.py", "layers/fp8.py")
# (scaling, kind, VARIANTS name, fp8_wgrad, main_grad)
CASES = [("tensorwise", "column", "ring", True, False),
         ("tensorwise", "column", "rs_dgrad_pipeline2", True, False),
         ("tensorwise", "column", "rs_dgrad_ring", True, True),
         ("tensorwise", "column", "ring", False, True),
         ("tensorwise", "row", "pipeline2", True, False),
         ("tensorwise", "row", "ring", True, True),
         ("tensorwise", "row", "pipeline2", False, False),
         ("delayed", "column", "ring", True, True),
         ("delayed", "column", "rs_dgrad_pipeline2", False, False),
         ("delayed", "row", "pipeline2", True, False),
         ("delayed", "row", "ring", False, True),
         ("rowwise", "column", "rs_dgrad_pipeline2", False, False),
         ("rowwise", "row", "pipeline2", False, True)]


def _fp8_ops(ll, ops, phase, wgrad_sites: bool) -> tuple[int, int]:
    """(bytes, kernels) of what FP8 code issued in `phase` (its amax exchange is the
    transport's, a transfer; with `wgrad_sites`, also the wgrad's accumulation)."""
    sites = FP8_SITES + (("layers/wgrad.py",) if wgrad_sites else ())
    mine = [o for o in ops if o.phase == phase and o.cls not in ll.HEAVY
            and not o.site.startswith("comm/") and any(s in o.site for s in sites)]
    return sum(o.read + o.written for o in mine), len(mine)


def _record(rank, world):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import layer_ledger as ll

    import megatron_overlap as mo
    from helpers.fp8_layers import config
    from helpers.layers import VARIANTS
    from helpers.megatron_cpu import init
    from megatron_overlap.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear
    from megatron_overlap.simulate.hardware import Layout
    from megatron_overlap.simulate.numerics import Numerics
    from megatron_overlap.simulate.passes import PassSpec, fp8_work
    from megatron_overlap.simulate.shapes import Shape

    init(world)
    out = []
    for scaling, kind, variant, fp8_wgrad, main_grad in CASES:
        overrides, flags = VARIANTS[kind][variant]
        fp8 = dict(fp8="hybrid", fp8_recipe="delayed" if scaling == "delayed" else "tensorwise",
                   fp8_wgrad=fp8_wgrad)
        mo.install(ub_cfgs=overrides, backend="torch_p2p",
                   fp8_scaling="rowwise" if scaling == "rowwise" else "tensorwise")
        try:
            layers = {}
            for arm, extra in (("bf16", {}), ("fp8", fp8)):
                cfg = config(world, True, torch.bfloat16, flags,
                             gradient_accumulation_fusion=main_grad, **extra)
                layers[arm] = (OverlapColumnParallelLinear(
                    K, N, config=cfg, init_method=torch.nn.init.normal_, bias=False,
                    gather_output=False, tp_comm_buffer_name="qkv") if kind == "column" else
                    OverlapRowParallelLinear(N, K, config=cfg, init_method=torch.nn.init.normal_,
                                             bias=False, input_is_parallel=True,
                                             skip_bias_add=True, tp_comm_buffer_name="proj"))
        finally:
            mo.uninstall()
        x = torch.randn(SEQ * (1 if kind == "column" else world), BATCH,
                        K if kind == "column" else N // world, dtype=torch.bfloat16)
        measured = {}
        for arm, layer in layers.items():
            layer.load_state_dict(layers["bf16"].state_dict())
            if main_grad:
                layer.weight.main_grad = torch.zeros(layer.weight.shape, dtype=torch.float32)
            ledger = ll.Ledger()
            with ll.compiled_kernels(ledger), ledger:
                # two first micro-batches (the second shows a schedule drives the flag),
                # then the ones counted: a step's first, and a later one
                for i, first in enumerate((True, True, True, False)):
                    layer.is_first_microbatch = first
                    ledger.recording, ledger.phase = i >= 2, f"forward{i}"
                    y, _ = layer(x.clone().requires_grad_(True))
                    ledger.phase = f"backward{i}"
                    y.backward(torch.ones_like(y))
            # the wgrad's accumulation is FP8 work where the wgrad runs in FP8 (else it is
            # the parameters' dtype path, the bf16 layer's too)
            fp8_acc = arm == "fp8" and fp8_wgrad and scaling != "rowwise"
            measured[arm] = {p: _fp8_ops(ll, ledger.ops, p, fp8_acc)
                             for p in ("forward2", "backward2", "forward3", "backward3")}
        plan = layers["fp8"].overlap_plan
        num = Numerics("bf16", "hybrid", scaling, fp8_wgrad=fp8_wgrad)
        tokens = SEQ * BATCH * world
        shape = (Shape("t", "qkv", tokens, K, N // world, world, numerics=num) if kind == "column"
                 else Shape("t", "proj", tokens, N // world, K, world, numerics=num))
        work = {p: fp8_work(PassSpec(shape, p), getattr(plan, p), Layout(world, backend="torch_p2p"),
                            accumulates=main_grad)
                for p in ("fprop", "dgrad", "wgrad")}
        both = lambda a, b: (a.bytes + b.bytes, a.kernels + b.kernels)  # noqa: E731
        backward = both(work["dgrad"].total, work["wgrad"].total)
        model = {"forward2": (work["fprop"].total.bytes, work["fprop"].total.kernels),
                 "forward3": (work["fprop"].activations.bytes, work["fprop"].activations.kernels),
                 "backward2": backward, "backward3": backward}
        out.append({"case": (scaling, kind, variant, fp8_wgrad, main_grad), "measured": measured,
                    "model": model, "weight_part": work["fprop"].weight.bytes})
    return out


@pytest.fixture(scope="module")
def recorded():
    return dist.run(_record, 2, timeout=300)[0]


@pytest.mark.parametrize("index", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_the_model_s_fp8_work_is_what_the_layers_issue(recorded, index):
    r = recorded[index]
    scaling = r["case"][0]
    assert all(k == 0 for _, k in r["measured"]["bf16"].values()), r  # no FP8 code in bf16
    for phase, (p_bytes, p_kernels) in r["model"].items():
        m_bytes, m_kernels = r["measured"]["fp8"][phase]
        assert m_kernels == p_kernels, (phase, r)
        slack = SCALARS if scaling != "rowwise" else m_bytes // 100
        assert abs(m_bytes - p_bytes) <= slack, (phase, r)
    # per tensor: the weight's cast and transposed copy at the step's first micro-batch only
    assert (r["weight_part"] > 0) == (scaling != "rowwise"), r
