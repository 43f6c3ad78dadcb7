"""Which FP8 GEMMs accumulate fast (torch._scaled_mm's use_fast_accum), as
`install(fp8_fast_accum=...)` says: by default the forward's, as Transformer Engine's
recipes and torchao's Float8Linear run them; 'none'; 'all'. Held at torch's own call, per
pass, through both layer kinds' passes (a ring column layer and a pipelined row layer
under SP, their backward included), for per-tensor and row-wise scales. (CPU's
`_scaled_mm` has one accumulation: the numbers are test_fp8_layers.py's; on a GPU,
tests/gpu/test_fp8_gpu.py holds them against torchao's Float8Linear.) Said in the
precision each layer reports, refused when unknown."""

import collections

import pytest
import torch

from helpers import dist
from helpers import fp8_layers as L

from megatron_overlap.layers.precision import layer_precision


def _accumulations(rank: int, world: int, fast: str, scaling: str) -> dict:
    """{pass: the use_fast_accum values torch._scaled_mm got} over one step of a column
    layer (ring all-gather) and a row layer (pipelined reduce-scatter) built under
    install(fp8_fast_accum=fast), and the precision each reports."""
    import megatron_overlap as mo
    from helpers.megatron_cpu import init
    from megatron_overlap.overlap import fp8

    init(world)
    seen: dict[str, list] = collections.defaultdict(list)
    op = [""]
    real_mm, calls = torch._scaled_mm, {}
    wgrad = scaling == "tensorwise"
    out = {}
    for kind, variant in (("column", "ring"), ("row", "pipeline2")):
        case = L.Fp8Case(kind, variant, True, "bfloat16", fp8_wgrad=wgrad, scaling=scaling)
        overrides, flags = L.VARIANTS[kind][variant]
        mo.install(ub_cfgs=overrides, fp8_scaling=scaling, fp8_fast_accum=fast)
        try:
            layer = L.build(kind, L.config(world, True, torch.bfloat16, flags, fp8="hybrid",
                                           fp8_recipe="tensorwise", fp8_wgrad=wgrad))
        finally:
            mo.uninstall()

        def spy_mm(*a, use_fast_accum=False, **kw):
            seen[op[0].rsplit("_", 1)[-1]].append(use_fast_accum)
            return real_mm(*a, use_fast_accum=use_fast_accum, **kw)

        def spy_call(cls):
            real = calls.setdefault(cls, cls.__call__)

            def call(self, a, b, out=None, **kw):
                op[0] = kw["op"]
                return real(self, a, b, out, **kw)
            return call
        torch._scaled_mm = spy_mm
        for cls in (fp8.ScaledGemm, fp8.RowScaledGemm):
            cls.__call__ = spy_call(cls)
        try:
            got = L.one_step(layer, case, rank, world, L._whole(case, world, torch.bfloat16))
        finally:
            torch._scaled_mm = real_mm
            for cls, real in calls.items():
                cls.__call__ = real
        out[kind] = {"precision": layer.precision.describe(),
                     "finite": all(bool(v.isfinite().all()) for v in got.values())}
    out["seen"] = {k: sorted(set(v)) for k, v in seen.items()}
    return out


@pytest.mark.parametrize("fast,scaling,want", [
    ("fprop", "tensorwise", {"fprop": [True], "dgrad": [False], "wgrad": [False]}),
    ("none", "tensorwise", {"fprop": [False], "dgrad": [False], "wgrad": [False]}),
    ("all", "tensorwise", {"fprop": [True], "dgrad": [True], "wgrad": [True]}),
    ("fprop", "rowwise", {"fprop": [True], "dgrad": [False]}),  # (its wgrad runs bf16)
])
def test_each_fp8_gemm_accumulates_as_installed(fast, scaling, want):
    for r in dist.run(_accumulations, 2, fast, scaling, timeout=240):
        assert r["seen"] == want, r["seen"]
        named = {"fprop": "fprop", "none": "none", "all": "fprop, dgrad, wgrad"}[fast]
        for kind in ("column", "row"):
            assert r[kind]["precision"].endswith(f"fast accumulation: {named})"), r[kind]
            assert r[kind]["finite"], r[kind]


def test_fast_accumulation_is_the_forwards_by_default_and_refused_when_unknown():
    import megatron_overlap as mo
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                            use_cpu_initialization=True, fp8="hybrid", fp8_recipe="tensorwise")
    p = layer_precision(cfg, "qkv (column)", 1)
    assert p.fast == ("fprop",) and p.fast_accum("fprop") and not p.fast_accum("dgrad")
    with pytest.raises(ValueError, match="fp8_fast_accum must be one of .*'fprop'"):
        mo.install(fp8_fast_accum="dgrad")
    mo.install(fp8_fast_accum="none")
    try:
        assert layer_precision(cfg, "qkv (column)", 1).fast == ()
        delayed = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                                    use_cpu_initialization=True, fp8="hybrid")
        assert layer_precision(delayed, "qkv (column)", 1).fast == ()
    finally:
        mo.uninstall()
    assert layer_precision(cfg, "qkv (column)", 1).fast == ("fprop",)  # restored
    assert layer_precision(TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                                             use_cpu_initialization=True), "x", 1).fast == ()
