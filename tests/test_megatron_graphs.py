"""Megatron's own CUDA-graph settings against the overlapped layers, at model build
(CPU; the captured runs themselves are tests/gpu/test_megatron_cuda_graphs.py):
Transformer Engine's graphing is refused, naming the setting; with the overlap off
it is Megatron's business; Megatron's local graphs turn our per-pass graphs off for the layer."""

import re

import pytest

from helpers import dist


def _build(rank, world, extra, overlap):
    import megatron_overlap as mo
    from helpers.gpt import make_config, make_model
    from helpers.megatron_cpu import init
    init(world)
    mo.install()
    try:
        config = make_config(world, "gelu_bias", overlap=overlap, **extra)
        try:
            model, _ = make_model(config)
        except Exception as exc:  # the refusal, returned for the parent to check
            return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        mo.uninstall()
    ours = [m for m in model.modules() if hasattr(m, "pass_graphs")]
    return {"error": None, "ours": len(ours), "impl": {m.megatron_graphs for m in ours},
            "off": sorted({g.off for m in ours for g in m.pass_graphs.values()}, key=str)}


def _te_graph_setting() -> dict:
    from megatron.core.transformer import TransformerConfig

    fields = TransformerConfig.__dataclass_fields__
    return ({"cuda_graph_impl": "transformer_engine"} if "cuda_graph_impl" in fields
            else {"external_cuda_graph": True})


def test_transformer_engine_graphs_refused_at_build_naming_the_setting():
    extra = _te_graph_setting()
    for r in dist.run(_build, 2, extra, True):
        assert r["error"] is not None, r
        assert r["error"].startswith("ConfigError"), r["error"]
        name = next(iter(extra))
        assert name in r["error"] and re.search(r"layer '(qkv|proj|fc1|fc2)", r["error"]), r["error"]
        assert "cuda_graph_impl='local'" in r["error"], r["error"]


def test_transformer_engine_graphs_left_alone_without_the_overlap():
    """tp_comm_overlap off: nothing of ours is built, so nothing is refused."""
    for r in dist.run(_build, 2, _te_graph_setting(), False):
        assert r["error"] is None, r["error"]
        assert r["ours"] == 0


def test_no_megatron_graphs_keeps_our_pass_graphs():
    for r in dist.run(_build, 2, {}, True):
        assert r["error"] is None and r["impl"] == {None}
        assert r["ours"] == 8 and r["off"] == [None]


@pytest.mark.parametrize("cfg,impl", [
    ({"cuda_graph_impl": "local"}, "local"),
    ({"enable_cuda_graph": True}, "local"),
    ({"cuda_graph_impl": "local", "cuda_graph_scope": ["full_iteration"]}, "full_iteration"),
    ({"cuda_graph_impl": "full_iteration"}, "full_iteration"),
    ({"cuda_graph_impl": "none"}, None),
])
def test_which_megatron_graphs_capture_a_layer(cfg, impl):
    """Every spelling megatron-core 0.14-0.19 has for its own graphs (read off the
    config object; a CUDA-graph manager cannot be built on CPU)."""
    from types import SimpleNamespace

    from megatron_overlap.layers.graphs import megatron_graphs

    assert megatron_graphs(SimpleNamespace(**cfg), "decoder.layers.0.linear_qkv") == impl
