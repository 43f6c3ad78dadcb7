"""Megatron's FP8 settings, read when an overlapped linear is built: each either runs as
configured or is refused there, naming the layer, the setting and what runs; never run
as bf16 in silence. And the layer's door: FP8 GEMM dimensions, token counts, the bytes
each pass moves (halved for the FP8 gathers)."""

import pytest
import torch

from helpers import dist

from megatron_overlap.config import ConfigError
from megatron_overlap.layers.precision import layer_precision


def _config(**kw):
    from megatron.core.transformer import TransformerConfig

    base = dict(num_layers=4, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True)
    return TransformerConfig(**{**base, **kw})


def _refusal(cfg, layer_number=2) -> ConfigError:
    with pytest.raises(ConfigError) as exc:
        layer_precision(cfg, "qkv (column)", layer_number)
    return exc.value


def test_bf16_model_runs_bf16():
    p = layer_precision(_config(), "qkv (column)", 1)
    assert not p.fp8 and p.describe() == "bf16"


@pytest.mark.parametrize("fmt,grad", [("hybrid", torch.float8_e5m2), ("e4m3", torch.float8_e4m3fn)])
def test_tensorwise_runs_with_megatrons_formats(fmt, grad):
    p = layer_precision(_config(fp8=fmt, fp8_recipe="tensorwise"), "qkv (column)", 2)
    assert (p.recipe, p.fwd, p.grad, p.wgrad) == ("tensorwise", torch.float8_e4m3fn, grad, True)
    off = layer_precision(_config(fp8=fmt, fp8_recipe="tensorwise", fp8_wgrad=False), "x", 2)
    assert not off.wgrad and "wgrad high precision" in off.describe()


def test_megatrons_default_recipe_delayed_runs_with_its_fields():
    cfg = _config(fp8="hybrid")  # fp8_recipe left at Megatron's default
    assert cfg.fp8_recipe == "delayed"
    p = layer_precision(cfg, "qkv (column)", 2)
    assert (p.recipe, p.fwd, p.grad, p.wgrad) == ("delayed", torch.float8_e4m3fn,
                                                   torch.float8_e5m2, True)
    assert (p.history, p.algo, p.margin) == (1, "most_recent", 0)  # Megatron's defaults
    assert "amax history 1 (most_recent), margin 0" in p.describe()
    assert p.dp_amax and "not over data-parallel ranks" in p.describe()  # reported, not done
    p = layer_precision(_config(fp8="e4m3", fp8_amax_history_len=1024, fp8_amax_compute_algo="max",
                                fp8_margin=2, tp_only_amax_red=True), "fc2 (row)", 2)
    assert (p.grad, p.history, p.algo, p.margin, p.dp_amax) == (torch.float8_e4m3fn, 1024, "max",
                                                                 2, False)
    assert "data-parallel" not in p.describe()


@pytest.mark.parametrize("kw,key", [
    (dict(fp8_amax_compute_algo="mean"), "fp8_amax_compute_algo"),
    (dict(fp8_amax_history_len=0), "fp8_amax_history_len"),
    (dict(fp8_margin=-1), "fp8_margin"),
    (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
     "fp8_recipe"),
    (dict(recompute_granularity="selective", recompute_modules=["mlp"]), "fp8_recipe")])
def test_delayed_settings_that_cannot_run_are_refused(kw, key):
    err = _refusal(_config(fp8="hybrid", **kw))
    assert err.key == key and "'qkv (column)'" in str(err), str(err)
    if key == "fp8_recipe":  # recompute: the reason and both ways out
        assert "twice" in str(err) and "tensorwise" in str(err) and "core_attn" in str(err)


def test_delayed_with_selective_recompute_of_core_attention_runs():
    p = layer_precision(_config(fp8="hybrid", recompute_granularity="selective"), "qkv", 2)
    assert p.recipe == "delayed"  # core_attn (the default module) recomputes no linear


def test_rowwise_scales_on_the_delayed_recipe_are_refused():
    from megatron_overlap.layers.precision import set_scaling

    before = set_scaling("rowwise")
    try:
        err = _refusal(_config(fp8="hybrid", fp8_recipe="delayed"))
    finally:
        set_scaling(before)
    assert err.key == "fp8_recipe" and "row-wise" in str(err) and "current scaling" in str(err)


@pytest.mark.parametrize("recipe", ["mxfp8", "blockwise", "custom", "rowwise", "nonsense"])
def test_other_recipes_are_refused(recipe):
    kw = {"fp8_quantizer_factory": "x.y"} if recipe == "custom" else {}
    err = _refusal(_config(fp8="e4m3", fp8_recipe=recipe, **kw))
    assert err.key == "fp8_recipe" and err.value == recipe and "tensorwise" in str(err)


@pytest.mark.parametrize("key,value", [("fp8_param", True), ("fp8_dot_product_attention", True),
                                       ("fp8_multi_head_attention", True), ("fp8_margin", 1),
                                       ("fp8_amax_history_len", 16),
                                       ("fp8_amax_compute_algo", "max")])
def test_settings_the_linears_cannot_honour_are_refused(key, value):
    err = _refusal(_config(fp8="hybrid", fp8_recipe="tensorwise", **{key: value}))
    assert (err.key, err.value) == (key, value) and f"set {key}=" in str(err)


def test_fp4_is_refused():
    err = _refusal(_config(fp4="e2m1"))
    assert err.key == "fp4"


@pytest.mark.parametrize("megatron_has_the_rule", [True, False])
def test_first_last_layers_bf16_follows_megatrons_rule(megatron_has_the_rule, monkeypatch):
    import megatron.core.fp8_utils as fp8_utils

    if not megatron_has_the_rule:  # megatron-core 0.14: the rule inline, no function
        monkeypatch.delattr(fp8_utils, "is_first_last_bf16_layer")
    cfg = _config(num_layers=6, fp8="hybrid", fp8_recipe="tensorwise", first_last_layers_bf16=True,
                  num_layers_at_start_in_bf16=2, num_layers_at_end_in_bf16=1)
    got = {n: layer_precision(cfg, "fc1 (column)", n) for n in range(1, 7)}
    assert [n for n, p in got.items() if not p.fp8] == [1, 2, 6]
    assert got[1].why.startswith("first_last_layers_bf16: layer 1 of 6")
    err = _refusal(cfg, layer_number=None)  # built where its layer is not known
    assert err.key == "first_last_layers_bf16" and "layer number is unknown" in str(err)


# -- built layers (TP 2): the door, the bytes, the number of the enclosing layer ---------------
def _built(rank, world):
    import megatron_overlap as mo
    from helpers.fp8_layers import build, config, rows_and_moved
    from helpers.megatron_cpu import init
    from megatron_overlap.comm import stats
    from megatron_overlap.layers.checks import LayerInputError

    init(world)
    fp8 = dict(fp8="hybrid", fp8_recipe="tensorwise")
    out = {}
    mo.install()
    try:
        for name, kind, extra in (("odd_width", "column", dict(hidden_size=40)),
                                  ("deferred", "row", dict(defer_embedding_wgrad_compute=True))):
            cfg = config(world, True, torch.bfloat16, **fp8)
            for k, v in extra.items():
                setattr(cfg, k, v)
            try:
                if name == "odd_width":
                    from megatron_overlap.layers import OverlapColumnParallelLinear
                    OverlapColumnParallelLinear(40, 40, config=cfg, init_method=torch.nn.init.zeros_,
                                                bias=False, gather_output=False,
                                                tp_comm_buffer_name="fc1")
                else:
                    build(kind, cfg)
                out[name] = "built"
            except ConfigError as exc:
                out[name] = str(exc)
        layers = {p: {k: build(k, config(world, True, torch.bfloat16, **(fp8 if p == "fp8" else {})))
                      for k in ("column", "row")} for p in ("fp8", "bf16")}
    finally:
        mo.uninstall()
    col = layers["fp8"]["column"]
    stats.snapshot()
    try:  # 8 tokens per rank, 16 in all: 16 divides; 4 per rank, 8 in all: it does not
        col(torch.randn(2, 2, 32, dtype=torch.bfloat16))
        out["odd_tokens"] = "ran"
    except LayerInputError as exc:
        out["odd_tokens"] = str(exc)
    out["moved_after_refusal"] = stats.snapshot()
    from megatron_overlap.telemetry.rows import layer_settings
    from megatron_overlap.telemetry.table import settings_table

    out.update(rows_and_moved(layers, world))
    for p, pair in layers.items():
        out[f"table_{p}"] = settings_table(layer_settings(torch.nn.ModuleDict(pair)))
    return out


@pytest.fixture(scope="module")
def built():
    return dist.run(_built, 2, timeout=240)[0]


def test_fp8_layer_refuses_what_its_gemm_cannot_take(built):
    assert "multiples of 16" in built["odd_width"] and "40 x 40" not in built["odd_width"]
    assert "20 x 40" in built["odd_width"]
    assert "defer_embedding_wgrad_compute=True" in built["deferred"]
    assert "runs bf16" in built["deferred"]
    assert "8 tokens" in built["odd_tokens"] and "fp8_wgrad=False" in built["odd_tokens"]
    assert built["moved_after_refusal"] == {}


def test_fp8_gathers_move_half_the_bytes_in_the_settings_rows(built):
    for k in ("column", "row"):
        fp8, bf16 = built[f"rows_fp8_{k}"], built[f"rows_bf16_{k}"]
        assert set(fp8) == set(bf16) and all(p.startswith("fp8 tensorwise") for _, p in fp8.values())
        assert all(p == "bf16" for _, p in bf16.values())
        halved = {"column": {"fprop", "dgrad"}, "row": {"dgrad"}}[k]
        for name, (nbytes, _) in fp8.items():
            want = bf16[name][0] // 2 if name in halved else bf16[name][0]
            assert nbytes == want and (nbytes > 0 or name == "wgrad"), (k, name, fp8, bf16)


def test_the_amax_exchange_is_a_named_transfer_of_one_float_per_rank(built):
    """Only what is gathered exchanges its amax: the column forward's input (SP) and
    the row backward's gradient; 4 bytes from each of the 2 ranks' all-gather."""
    fp8, bf16 = built["moved_fp8"], built["moved_bf16"]
    assert {op for op in fp8 if op.endswith("_amax")} == {"qkv_fprop_amax", "proj_dgrad_amax"}
    assert fp8["qkv_fprop_amax"] == fp8["proj_dgrad_amax"] == 4
    assert not any(op.endswith("_amax") for op in bf16)
    assert 2 * fp8["qkv_fprop"] == bf16["qkv_fprop"] and 2 * fp8["proj_dgrad"] == bf16["proj_dgrad"]
    assert fp8["proj_fprop"] == bf16["proj_fprop"]  # the reduce-scatter stays bf16


def test_the_settings_table_says_each_layers_precision(built):
    assert "Precision:" in built["table_fp8"]
    assert ("fp8 tensorwise (e4m3fn fprop, e5m2 grads, wgrad fp8, fast accumulation: fprop): 2 layers"
            in built["table_fp8"])
    assert "Precision:" not in built["table_bf16"]


def _mixed(rank, world):
    """Rank 0 configured for FP8, rank 1 not: its passes would move other bytes (no amax
    exchange, bf16 gathers), so the first call is a diagnosed disagreement, no transfer."""
    from helpers.fp8_layers import first_call

    return first_call(world, {}, **(dict(fp8="hybrid", fp8_recipe="tensorwise") if rank == 0 else {}))


def test_ranks_that_disagree_on_fp8_are_diagnosed_before_any_transfer():
    for r in dist.run(_mixed, 2, timeout=240):
        assert r["error"] and "precision" in r["error"] and "fp8 tensorwise" in r["error"], r
        assert r["moved"] == {}


def _build_plain_fp8_gpt(rank, world):
    import logging

    import megatron_overlap as mo
    from helpers.gpt import make_config, make_model
    from helpers.megatron_cpu import init
    from megatron_overlap.config import console

    init(world)
    console._said.clear()
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    log = logging.getLogger("megatron_overlap")
    log.addHandler(handler)
    mo.install()
    try:
        make_model(make_config(world, "swiglu_gqa_rms", overlap=False, fp8="hybrid",
                               fp8_recipe="tensorwise"))
        make_model(make_config(world, "swiglu_gqa_rms", overlap=True, fp8="hybrid",
                               fp8_recipe="tensorwise"))
    finally:
        mo.uninstall()
        log.removeHandler(handler)
    return [m for m in seen if "is Megatron's own" in m]


def test_an_fp8_config_on_megatrons_own_linears_is_reported_not_run_as_bf16_in_silence():
    """With tp_comm_overlap=False every linear stays Megatron's (bf16/fp32, as megatron-core
    runs them without Transformer Engine): a warning names each kind, reason and fix; with
    it on, only the output layer stays Megatron's, and says so."""
    for said in dist.run(_build_plain_fp8_gpt, 2):
        off = [m for m in said if "tp_comm_overlap=False" in m]
        assert {m.split("'")[1] for m in off} >= {"qkv", "proj", "fc1", "fc2"}, said
        assert all("not fp8='hybrid'" in m and "set tp_comm_overlap=True" in m for m in off)
        on = [m for m in said if "tp_comm_overlap=False" not in m]
        assert on and all("not one of the linears" in m for m in on), said
