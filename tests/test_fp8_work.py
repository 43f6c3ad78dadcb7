"""The cost model's FP8 work (megatron_overlap/simulate/fp8_work.py) against what the
layers issue: a column and a row layer (SP, TP 2, bf16 parameters, Transformer Engine's
default settings), one forward + backward each in bf16 and in FP8 (tensorwise and
row-wise), every device operation recorded by benchmarks/layer_ledger.py's dispatch mode
(GEMMs not computed; each compiled FP8 kernel one operation, as on a GPU). What the FP8
layer issues beyond the bf16 one, outside its GEMMs and transfers, must be what the model
says the layer's three passes add: the same kernels, the same bytes (but the 4-byte
scalars: amaxes, scales and their reciprocals). What the FP8 layer issues: the operations
whose innermost frame in megatron_overlap is FP8 code (overlap/fp8.py, layers/fp8.py), of
which the bf16 layer issues none."""

import os
import sys

import pytest
import torch

from helpers import dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
K, N, SEQ, BATCH = 64, 128, 32, 2  # hidden, column output (row input); per rank 32 x 2 tokens
SCALARS = 4096  # bytes of 4-byte scalars the model leaves out, at most, per layer


def _record(rank, world, scaling):
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import layer_ledger as ll

    import megatron_overlap as mo
    from helpers.fp8_layers import config
    from helpers.megatron_cpu import init
    from megatron_overlap.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear
    from megatron_overlap.simulate.hardware import Layout
    from megatron_overlap.simulate.numerics import Numerics
    from megatron_overlap.simulate.passes import PassSpec, fp8_work
    from megatron_overlap.simulate.shapes import Shape

    init(world)
    fp8 = dict(fp8="hybrid", fp8_recipe="tensorwise")
    if scaling == "rowwise":
        fp8["fp8_wgrad"] = False
    mo.install(backend="torch_p2p", fp8_scaling=scaling)
    try:
        layers = {}
        for arm, extra in (("bf16", {}), ("fp8", fp8)):
            cfg = config(world, True, torch.bfloat16, **extra)
            layers[arm] = {
                "column": OverlapColumnParallelLinear(K, N, config=cfg, init_method=torch.nn.init.normal_,
                                                      bias=False, gather_output=False,
                                                      tp_comm_buffer_name="qkv"),
                "row": OverlapRowParallelLinear(N, K, config=cfg, init_method=torch.nn.init.normal_,
                                                bias=False, input_is_parallel=True,
                                                skip_bias_add=True, tp_comm_buffer_name="proj")}
    finally:
        mo.uninstall()
    out = {}
    for kind in ("column", "row"):
        x = torch.randn(SEQ * (1 if kind == "column" else world), BATCH, K if kind == "column" else N // world,
                        dtype=torch.bfloat16)
        rest = {}
        for arm in ("bf16", "fp8"):
            layer = layers[arm][kind]
            layer.load_state_dict(layers["bf16"][kind].state_dict())
            ledger = ll.Ledger()
            with ll.compiled_kernels(ledger), ledger:
                for recording in (False, True):  # a first call (agreement, topology), then the one counted
                    ledger.recording = recording
                    xi = x.clone().requires_grad_(True)
                    y, _ = layer(xi)
                    y.backward(torch.ones_like(y))
            # what the FP8 code issues (its amax exchange is the transport's: a transfer)
            ops = [o for o in ledger.ops if o.cls not in ll.HEAVY and not o.site.startswith("comm/")
                   and ("overlap/fp8.py" in o.site or "layers/fp8.py" in o.site)]
            rest[arm] = (sum(o.read + o.written for o in ops), len(ops))
        plan = layers["fp8"][kind].overlap_plan
        num = Numerics("bf16", "hybrid", scaling, fp8_wgrad=scaling != "rowwise")
        tokens = SEQ * BATCH * world
        shape = (Shape("t", "qkv", tokens, K, N // world, world, numerics=num) if kind == "column"
                 else Shape("t", "proj", tokens, N // world, K, world, numerics=num))
        layout = Layout(world, backend="torch_p2p")
        model = [fp8_work(PassSpec(shape, p), getattr(plan, p), layout).total
                 for p in ("fprop", "dgrad", "wgrad")]
        out.setdefault("bf16_fp8_sites", {})[kind] = rest["bf16"][1]
        out[kind] = {"measured": rest["fp8"],
                     "model": (sum(w.bytes for w in model), sum(w.kernels for w in model)),
                     "methods": [getattr(getattr(plan, p), "method", None) for p in ("fprop", "dgrad", "wgrad")]}
    return out


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_the_model_s_fp8_work_is_what_the_layers_issue(scaling):
    got = dist.run(_record, 2, scaling, timeout=240)[0]
    for kind in ("column", "row"):
        r = got[kind]
        (m_bytes, m_kernels), (p_bytes, p_kernels) = r["measured"], r["model"]
        assert got["bf16_fp8_sites"][kind] == 0, got  # the bf16 layer: no FP8 code ran
        assert m_kernels == p_kernels, (kind, r)
        # tensorwise: but 4-byte scalars; row-wise: but the [rows, 1] scales' bytes (a row
        # is 64 elements here, so those weigh more than at a model's widths)
        slack = SCALARS if scaling == "tensorwise" else m_bytes // 100
        assert abs(m_bytes - p_bytes) <= slack, (kind, r)
