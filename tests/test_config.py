"""megatron_overlap.config: TE's ub_cfgs defaults, loading, validation, effects, table.

The expected values are Transformer Engine's, read from
transformer_engine/pytorch/module/base.py :: initialize_ub (its `methods` table,
layers_all_gather_overlap / layers_reduce_scatter_overlap, ag_rs_pairs,
external_gemm_to_overlap, dgrad_reduce_scatter_overlap, get_default_config and add_ub's
checks). No torch.distributed anywhere.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import re

import pytest
import yaml

from megatron_overlap.config import (
    BACKENDS, KEYS, LAYER_NAMES, METHODS, ConfigError, LayerSettings, OverlapConfig,
)

# TE initialize_ub: `methods` table (recent TE adds "external" for proj_wgrad/fc2_wgrad).
TE_METHODS = {
    "qkv_fprop": "ring_exchange", "fc1_fprop": "ring_exchange",
    "proj_dgrad": "ring_exchange", "fc2_dgrad": "ring_exchange",
    "proj_fprop": "pipeline", "fc2_fprop": "pipeline",
    "qkv_dgrad": "bulk", "qkv_wgrad": "bulk", "fc1_dgrad": "bulk", "fc1_wgrad": "bulk",
    "proj_wgrad": "external", "fc2_wgrad": "external",
}
# TE initialize_ub: layers_reduce_scatter_overlap (everything else is all-gather).
TE_REDUCE_SCATTER = {"proj_fprop", "fc2_fprop", "qkv_wgrad", "fc1_wgrad"}
# TE get_default_config, per method.
TE_RING = dict(num_sm=1, cga_size=1, set_sm_margin=False, num_splits=None)  # splits = TP size
TE_OTHER = dict(num_sm=16, cga_size=2, set_sm_margin=True, num_splits=4)
TE_COMMON = dict(atomic_gemm=False, use_ce=True, comm_priority=0,
                 gemm_priority=0, pipeline_rs_overlap_first_gemm=False)
# TE's aggregate defaults to false; ours to "auto" (config.names.AGGREGATE_AUTO)


@pytest.fixture(scope="module")
def defaults() -> OverlapConfig:
    return OverlapConfig.load(None)


# --------------------------------------------------------------------------- constants / defaults
def test_public_constants():
    assert LAYER_NAMES == ("qkv_fprop", "qkv_dgrad", "qkv_wgrad", "proj_fprop", "proj_dgrad",
                           "proj_wgrad", "fc1_fprop", "fc1_dgrad", "fc1_wgrad", "fc2_fprop",
                           "fc2_dgrad", "fc2_wgrad")
    assert set(LAYER_NAMES) == set(TE_METHODS)
    assert METHODS == ("ring_exchange", "pipeline", "bulk", "external")
    assert BACKENDS == ("torch_p2p", "symm", "nvshmem")
    assert issubclass(ConfigError, ValueError)


def test_defaults_are_te_defaults(defaults):
    assert list(defaults) == list(LAYER_NAMES) and len(defaults) == 12
    for name, s in defaults.items():
        assert s.method == TE_METHODS[name], name
        per_method = TE_RING if s.method == "ring_exchange" else TE_OTHER
        for key, value in {**per_method, **TE_COMMON}.items():
            assert getattr(s, key) == value, (name, key)
        assert s.aggregate == "auto", name
        # get_default_config: fp8_buf = name in layers_all_gather_overlap
        assert s.fp8_buf == (name not in TE_REDUCE_SCATTER), name
        assert s.is_reduce_scatter == (name in TE_REDUCE_SCATTER), name
    assert OverlapConfig.load({}) == defaults == OverlapConfig.load("\n")


def test_layer_name_parts_and_splits(defaults):
    s = defaults["fc2_dgrad"]
    assert (s.buffer_name, s.pass_name) == ("fc2", "dgrad")
    assert defaults["qkv_fprop"].splits(8) == 8  # ring exchange: TP chunks
    assert defaults["proj_fprop"].splits(8) == 4  # pipeline: TE's default num_splits
    assert defaults["qkv_dgrad"].splits(8) == 1 and defaults["proj_wgrad"].splits(8) == 1
    assert defaults.replace("proj_fprop", num_splits=8)["proj_fprop"].splits(2) == 8
    with pytest.raises(ConfigError, match="qkv_fprop.*tp_size"):
        defaults["qkv_fprop"].splits(0)


def test_layer_settings_default_follows_method():
    s = LayerSettings.default("proj_fprop", "ring_exchange")
    assert (s.num_sm, s.cga_size, s.set_sm_margin, s.num_splits) == (1, 1, False, None)
    assert s == LayerSettings.default("proj_fprop", "ring_exchange")


# --------------------------------------------------------------------------- loading
def test_partial_override_keeps_other_defaults(defaults):
    cfg = OverlapConfig.load({"proj_fprop": {"num_sm": 24}, "qkv_dgrad": {"cga_size": 4}})
    assert cfg["proj_fprop"].num_sm == 24 and cfg["proj_fprop"].method == "pipeline"
    assert cfg["proj_fprop"].num_splits == 4 and cfg["proj_fprop"].set_sm_margin is True
    assert cfg["qkv_dgrad"].cga_size == 4 and cfg["qkv_dgrad"].num_sm == 16
    for name in set(LAYER_NAMES) - {"proj_fprop", "qkv_dgrad"}:
        assert cfg[name] == defaults[name]


def test_per_method_defaults_follow_a_method_change():
    cfg = OverlapConfig.load({"proj_fprop": {"method": "ring_exchange"},
                              "fc2_fprop": {"method": "ring_exchange", "num_sm": 2}})
    p = cfg["proj_fprop"]
    assert (p.num_sm, p.cga_size, p.set_sm_margin, p.num_splits) == (1, 1, False, None)
    assert cfg["fc2_fprop"].num_sm == 2 and cfg["fc2_fprop"].cga_size == 1
    # TE keys these defaults to the layer's default method; the difference is reported.
    assert any("proj_fprop" in n and "TE" in n and "num_sm=16" in n for n in cfg.notes)
    assert not any("fc2_fprop" in n and "num_sm" in n for n in cfg.notes)


def test_zero_one_booleans_accepted():
    cfg = OverlapConfig.load({"proj_fprop": {"set_sm_margin": 0, "fp8_buf": 1},
                              "qkv_fprop": {"aggregate": 1, "use_ce": 0}})
    assert cfg["proj_fprop"].set_sm_margin is False and cfg["proj_fprop"].fp8_buf is True
    assert cfg["qkv_fprop"].aggregate is True and cfg["qkv_fprop"].use_ce is False
    assert cfg == OverlapConfig.load({"proj_fprop": {"set_sm_margin": False, "fp8_buf": True},
                                      "qkv_fprop": {"aggregate": True, "use_ce": False}})


def test_load_yaml_file_pathlike_and_str(tmp_path):
    path = tmp_path / "ub.yaml"
    path.write_text("qkv_fprop:\n  method: ring_exchange\n  aggregate: 1\n"
                    "fc2_fprop:\n  num_sm: 8\n  num_splits: 2\n")
    for source in (path, str(path)):
        cfg = OverlapConfig.load(source)
        assert cfg["qkv_fprop"].aggregate is True
        assert cfg["fc2_fprop"].splits(8) == 2 and cfg["fc2_fprop"].num_sm == 8
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert OverlapConfig.load(empty) == OverlapConfig.load(None)


def test_round_trips(tmp_path, defaults):
    cfg = (defaults.replace("proj_fprop", num_sm=24, num_splits=8, pipeline_rs_overlap_first_gemm=1)
           .replace("qkv_fprop", aggregate=True, use_ce=False, comm_priority=-3)
           .replace("qkv_wgrad", num_sm=4))
    text = cfg.to_yaml()
    assert OverlapConfig.load(text) == cfg
    assert OverlapConfig.load(cfg.to_dict()) == cfg
    out = tmp_path / "out.yaml"
    assert cfg.to_yaml(out) == out.read_text()
    assert OverlapConfig.load(out) == cfg
    plain = yaml.safe_load(text)  # a plain TE ub_cfgs dict: layer -> {key: value}
    assert set(plain) == set(LAYER_NAMES) and set(plain["qkv_fprop"]) <= set(KEYS)
    assert "num_splits" not in plain["qkv_fprop"]  # None: TE's default, left out
    for rs in (False, True):
        c = OverlapConfig.load(None, rs_dgrad=rs)
        assert OverlapConfig.load(c.to_yaml()) == c and OverlapConfig.load(c.to_dict()) == c


# A NeMo recipe as YAML: nemo/collections/llm/recipes/tp_overlap_configs/userbuffers.py,
# userbuffers_bf16_h100_h8192_tp4_mbs1_seqlen8192 (Llama 70B, H100), with the keys NeMo's
# Bulk/RingExchange/PipelineOverlapCfg dataclasses write, plus TE's is_reduce_scatter key.
NEMO_LLAMA70B_H100 = """
qkv_dgrad: {method: bulk, num_sm: 4, cga_size: 2, set_sm_margin: false}
qkv_wgrad: {method: bulk, num_sm: 24, cga_size: 2, set_sm_margin: false}
fc1_dgrad: {method: bulk, num_sm: 2, cga_size: 2, set_sm_margin: false}
fc1_wgrad: {method: bulk, num_sm: 4, cga_size: 2, set_sm_margin: false}
qkv_fprop: {method: ring_exchange, aggregate: false, num_sm: 1, cga_size: 1,
            set_sm_margin: false, fp8_buf: false, atomic_gemm: false}
proj_dgrad: {method: ring_exchange, aggregate: false, num_sm: 1, cga_size: 1,
             set_sm_margin: false, fp8_buf: false, atomic_gemm: false, is_reduce_scatter: false}
fc1_fprop: {method: ring_exchange, aggregate: false, num_sm: 1, cga_size: 1,
            set_sm_margin: false, fp8_buf: false, atomic_gemm: false}
fc2_dgrad: {method: ring_exchange, aggregate: false, num_sm: 1, cga_size: 1,
            set_sm_margin: false, fp8_buf: false, atomic_gemm: false}
proj_fprop: {method: pipeline, num_sm: 24, cga_size: 2, num_splits: 4, set_sm_margin: true,
             fp8_buf: false, atomic_gemm: false}
fc2_fprop: {method: pipeline, num_sm: 16, cga_size: 2, num_splits: 4, set_sm_margin: true,
            fp8_buf: false, atomic_gemm: false}
"""
# NeMo 1.x examples/nlp/language_modeling/conf/tp_overlap/ub_cfg_h100_h12288_tp8_mbs2_seqlen2048.yaml
NEMO_GPT175B_H100 = """
# UB communicator configurations
qkv_dgrad: {method: bulk, num_sm: 8, cga_size: 2, set_sm_margin: 0}
qkv_wgrad: {method: bulk, num_sm: 16, cga_size: 2, set_sm_margin: 0}
fc1_dgrad: {method: bulk, num_sm: 4, cga_size: 2, set_sm_margin: 0}
fc1_wgrad: {method: bulk, num_sm: 16, cga_size: 2, set_sm_margin: 0}
qkv_fprop: {method: ring_exchange, aggregate: 0}
proj_dgrad: {method: ring_exchange, aggregate: 1}
fc1_fprop: {method: ring_exchange, aggregate: 0}
fc2_dgrad: {method: ring_exchange, aggregate: 0}
proj_fprop: {method: pipeline, num_sm: 16, cga_size: 2, num_splits: 4, set_sm_margin: 1}
fc2_fprop: {method: pipeline, num_sm: 24, cga_size: 2, num_splits: 4, set_sm_margin: 1}
"""
# NeMo userbuffers_fp8_h100_h8192_tp2_mbs1_seqlen4096_lora: wgrads None, fc1_dgrad reduce-scatters.
NEMO_LORA = """
qkv_dgrad: {method: bulk, num_sm: 2, cga_size: 2, set_sm_margin: false}
qkv_wgrad: null
fc1_dgrad: {method: pipeline, num_sm: 16, cga_size: 2, num_splits: 4, set_sm_margin: true,
            fp8_buf: true}
fc1_wgrad: null
qkv_fprop: {method: ring_exchange, set_sm_margin: true}
proj_dgrad: {method: ring_exchange, set_sm_margin: true}
fc1_fprop: {method: ring_exchange, set_sm_margin: true}
fc2_dgrad: {method: ring_exchange, set_sm_margin: true}
proj_fprop: {method: ring_exchange, cga_size: 2, set_sm_margin: true, fp8_buf: true}
fc2_fprop: {method: ring_exchange, cga_size: 2, set_sm_margin: true, fp8_buf: true}
"""


@pytest.mark.parametrize("text", [NEMO_LLAMA70B_H100, NEMO_GPT175B_H100, NEMO_LORA],
                         ids=["nemo2-llama70b-h100", "nemo1-gpt175b-h100", "nemo2-lora"])
def test_real_world_configs_load_unchanged(tmp_path, text):
    path = tmp_path / "ub_cfg.yaml"
    path.write_text(text)
    cfg = OverlapConfig.load(path)
    for name, entry in yaml.safe_load(text).items():
        for key, value in (entry or {}).items():
            if key == "is_reduce_scatter":
                assert cfg[name].is_reduce_scatter == value
            else:
                assert getattr(cfg[name], key) == value, (name, key)
    assert OverlapConfig.load(cfg.to_yaml()) == cfg


def test_nemo_lora_details():
    cfg = OverlapConfig.load(NEMO_LORA)
    assert cfg.rs_dgrad_layers == ("fc1_dgrad",) and cfg.unused_layers == ("fc1_wgrad",)
    assert cfg["fc1_dgrad"].is_reduce_scatter and cfg["fc1_dgrad"].splits(2) == 4
    assert cfg["qkv_wgrad"] == LayerSettings.default("qkv_wgrad")
    notes = " ".join(cfg.notes)
    assert "qkv_wgrad: null" in notes and "tp_comm_overlap_rs_dgrad" in notes
    # ring_exchange defaults follow the given method on proj_fprop; TE would keep pipeline's
    assert cfg["proj_fprop"].num_sm == 1 and "TE's initialize_ub keeps pipeline's" in notes


def test_is_reduce_scatter_key_is_checked_and_reported():
    cfg = OverlapConfig.load({"qkv_fprop": {"is_reduce_scatter": 0},
                              "proj_fprop": {"is_reduce_scatter": True}})
    assert sum("is_reduce_scatter" in n for n in cfg.notes) == 2
    assert "is_reduce_scatter" not in cfg.to_dict()["qkv_fprop"]
    with pytest.raises(ConfigError, match=r"'qkv_fprop', key 'is_reduce_scatter': got True"):
        OverlapConfig.load({"qkv_fprop": {"is_reduce_scatter": True}})


# --------------------------------------------------------------------------- rs_dgrad
def test_rs_dgrad_defaults():
    cfg = OverlapConfig.load(None, rs_dgrad=True)
    for d, w in (("qkv_dgrad", "qkv_wgrad"), ("fc1_dgrad", "fc1_wgrad")):
        # TE's module with tp_comm_overlap_rs_dgrad and a bulk communicator runs
        # split_overlap_rs (comm_type RS, bulk_overlap=False), i.e. the pipeline path.
        assert cfg[d].method == "pipeline" and cfg[d].is_reduce_scatter
        assert cfg[d].fp8_buf is False  # TE moves it out of layers_all_gather_overlap
        assert (cfg[d].num_sm, cfg[d].cga_size, cfg[d].num_splits) == (16, 2, 4)
        assert w in cfg.unused_layers and w not in cfg.to_dict()
        assert set(cfg.effects(w, "symm").values()) == {
            f"no effect: unused while {d} reduce-scatters (TE turns the bulk wgrad off)"}
    base = OverlapConfig.load(None)
    for name in set(LAYER_NAMES) - {"qkv_dgrad", "fc1_dgrad"}:
        assert cfg[name] == base[name]


def test_rs_dgrad_follows_given_methods_and_reports():
    # TE's own rs-dgrad test config (tests/pytorch/distributed/run_layer_with_overlap.py)
    te_test = {"qkv_dgrad": {"method": "ring_exchange"}, "fc1_dgrad": {"method": "ring_exchange"}}
    for rs in (False, True):
        cfg = OverlapConfig.load(te_test, rs_dgrad=rs)
        assert cfg["qkv_dgrad"].method == "ring_exchange" and cfg["qkv_dgrad"].is_reduce_scatter
        assert cfg["qkv_dgrad"].num_sm == 1  # TE: defaults follow the switched method here
    cfg = OverlapConfig.load(NEMO_GPT175B_H100, rs_dgrad=True)
    assert cfg["qkv_dgrad"].method == "pipeline" and cfg["qkv_dgrad"].num_sm == 8
    assert cfg["qkv_wgrad"] == LayerSettings.default("qkv_wgrad")
    notes = " ".join(cfg.notes)
    assert "qkv_dgrad: method bulk read as pipeline" in notes
    assert "qkv_wgrad: settings ignored" in notes


# --------------------------------------------------------------------------- errors
def test_unknown_layer_suggests_closest(defaults):
    with pytest.raises(ConfigError, match=r"unknown layer 'qkv_fprp' \(did you mean 'qkv_fprop'\?\)"
                       r".*allowed layers: qkv_fprop, qkv_dgrad"):
        OverlapConfig.load({"qkv_fprp": {"num_sm": 2}})
    with pytest.raises(ConfigError, match="did you mean 'fc2_dgrad'"):
        defaults["fc2_dgard"]
    with pytest.raises(KeyError):  # Mapping contract
        defaults["nope"]
    assert defaults.get("nope") is None and "nope" not in defaults
    with pytest.raises(ConfigError, match="did you mean 'proj_fprop'"):
        defaults.replace("proj_frop", num_sm=2)


def test_unknown_key_suggests_closest(defaults):
    with pytest.raises(ConfigError, match=r"layer 'proj_fprop': unknown key 'num_sms' "
                       r"\(did you mean 'num_sm'\?\); allowed keys: method, num_sm"):
        OverlapConfig.load({"proj_fprop": {"num_sms": 2}})
    with pytest.raises(ConfigError, match=r"'qkv_fprop': unknown key 'agregate'.*'aggregate'"):
        defaults.replace("qkv_fprop", agregate=True)


@pytest.mark.parametrize("layer,key,value,allowed", [
    ("proj_fprop", "num_sm", 0, "an int >= 1"),
    ("proj_fprop", "num_sm", "16", "an int >= 1"),
    ("proj_fprop", "num_sm", 16.0, "an int >= 1"),
    ("proj_fprop", "num_sm", True, "an int >= 1"),
    ("proj_fprop", "cga_size", 0, "an int in 1..8"),
    ("proj_fprop", "cga_size", 9, "an int in 1..8"),
    ("proj_fprop", "num_splits", 0, "an int >= 1"),
    ("proj_fprop", "num_splits", "4", "an int >= 1"),
    ("qkv_fprop", "set_sm_margin", 2, "true/false or 0/1"),
    ("qkv_fprop", "aggregate", "yes", "true/false or 0/1"),
    ("qkv_fprop", "use_ce", None, "true/false or 0/1"),
    ("qkv_fprop", "comm_priority", 1.5, "an int"),
    ("qkv_fprop", "gemm_priority", False, "an int"),
    ("qkv_fprop", "method", "ring", "ring_exchange, pipeline, bulk, external"),
    ("qkv_fprop", "method", 3, "ring_exchange, pipeline, bulk, external"),
])
def test_bad_values(defaults, layer, key, value, allowed):
    pattern = rf"layer '{layer}', key '{key}': got {re.escape(repr(value))}; allowed: " + \
        re.escape(allowed)
    with pytest.raises(ConfigError, match=pattern) as info:
        OverlapConfig.load({layer: {key: value}})
    assert (info.value.layer, info.value.key) == (layer, key)
    with pytest.raises(ConfigError, match=pattern):
        defaults.replace(layer, **{key: value})


def test_bad_method_suggests_closest():
    with pytest.raises(ConfigError, match="did you mean 'ring_exchange'"):
        OverlapConfig.load({"qkv_fprop": {"method": "ring_exchnage"}})


@pytest.mark.parametrize("layer", ["qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad"])
def test_pipeline_rejected_for_all_gather_layers(layer):
    # TE add_ub: "`pipeline` overlap method is not supported for AllGather"
    with pytest.raises(ConfigError, match=rf"'{layer}', key 'method': got 'pipeline'; "
                       r"allowed: ring_exchange .*all-gather"):
        OverlapConfig.load({layer: {"method": "pipeline"}})


def test_pipeline_allowed_where_te_allows_it():
    cfg = OverlapConfig.load({"fc1_dgrad": {"method": "pipeline"},
                              "fc2_fprop": {"method": "pipeline"}})
    assert cfg["fc1_dgrad"].is_reduce_scatter and cfg["fc2_fprop"].is_reduce_scatter


@pytest.mark.parametrize("method", ["ring_exchange", "pipeline", "bulk"])
def test_external_layers_must_be_external(method):
    # TE add_ub: proj_wgrad/fc2_wgrad (external_gemm_to_overlap) must use `external`
    with pytest.raises(ConfigError, match=r"'fc2_wgrad', key 'method'.*allowed: external"):
        OverlapConfig.load({"fc2_wgrad": {"method": method}})


@pytest.mark.parametrize("layer", ["qkv_fprop", "proj_fprop", "qkv_dgrad", "qkv_wgrad"])
def test_external_only_for_external_layers(layer):
    with pytest.raises(ConfigError, match=rf"'{layer}', key 'method': got 'external'"):
        OverlapConfig.load({layer: {"method": "external"}})


@pytest.mark.parametrize("layer", ["qkv_fprop", "proj_fprop", "fc2_dgrad"])
def test_bulk_only_for_bulk_layers(layer):
    with pytest.raises(ConfigError, match=rf"'{layer}', key 'method': got 'bulk'.*only for "
                       "qkv_dgrad, qkv_wgrad, fc1_dgrad, fc1_wgrad"):
        OverlapConfig.load({layer: {"method": "bulk"}})


@pytest.mark.parametrize("method", ["ring_exchange", "pipeline"])
def test_wgrad_bulk_only(method):
    with pytest.raises(ConfigError, match=rf"'fc1_wgrad', key 'method': got '{method}'; "
                       "allowed: bulk"):
        OverlapConfig.load({"fc1_wgrad": {"method": method}})


def test_atomic_gemm_pairs():
    # TE add_ub: atomic GEMM + ring_exchange on one half of a TP block needs it on the other.
    for given in ({"qkv_fprop": {"atomic_gemm": 1}},
                  {"fc2_fprop": {"method": "ring_exchange", "atomic_gemm": True}},
                  {"qkv_fprop": {"atomic_gemm": True}, "proj_fprop": {"atomic_gemm": True}}):
        rs = "proj_fprop" if "qkv_fprop" in given else "fc2_fprop"
        with pytest.raises(ConfigError, match=rf"layer '{rs}', key 'atomic_gemm'.*both use "
                           "atomic_gemm with ring_exchange, or neither"):
            OverlapConfig.load(given)
    cfg = OverlapConfig.load({"qkv_fprop": {"atomic_gemm": True},
                              "proj_fprop": {"method": "ring_exchange", "atomic_gemm": True},
                              "fc2_fprop": {"atomic_gemm": True}})  # pipeline alone: allowed
    assert cfg["qkv_fprop"].effects("symm")["atomic_gemm"] == \
        "fallback: non-atomic GEMM (atomic GEMM not implemented)"


def test_wgrad_refused_while_its_dgrad_reduce_scatters(defaults):
    # TE initialize_ub: "Cannot specify user UB config for 'qkv_wgrad' when its corresponding
    # dgrad 'qkv_dgrad' uses a non-bulk overlap method"
    with pytest.raises(ConfigError, match=r"layer 'qkv_wgrad', key 'num_sm': cannot be "
                       r"configured while 'qkv_dgrad' uses 'ring_exchange'"):
        OverlapConfig.load({"qkv_dgrad": {"method": "ring_exchange"}, "qkv_wgrad": {"num_sm": 2}})
    rs = OverlapConfig.load(None, rs_dgrad=True)
    with pytest.raises(ConfigError, match=r"layer 'fc1_wgrad', key 'num_sm': cannot be configured"):
        rs.replace("fc1_wgrad", num_sm=2)
    with pytest.raises(ConfigError, match=r"layer 'qkv_wgrad', key 'num_sm': got 3"):
        defaults.replace("qkv_wgrad", num_sm=3).replace("qkv_dgrad", method="ring_exchange")


def test_malformed_sources(tmp_path):
    with pytest.raises(ConfigError, match=r"layer 'qkv_fprop': expected a mapping"):
        OverlapConfig.load({"qkv_fprop": 3})
    with pytest.raises(ConfigError, match="does not exist"):
        OverlapConfig.load(str(tmp_path / "missing.yaml"))
    with pytest.raises(ConfigError, match="cannot read"):
        OverlapConfig.load(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        OverlapConfig.load("qkv_fprop: [\n")
    with pytest.raises(ConfigError, match="expected a mapping of layer names"):
        OverlapConfig.load("- a\n- b\n")
    with pytest.raises(ConfigError, match="got list"):
        OverlapConfig.load([("qkv_fprop", {})])


def test_constructor_checks(defaults):
    layers = dict(defaults)
    del layers["fc2_wgrad"]
    with pytest.raises(ConfigError, match="missing layers: fc2_wgrad"):
        OverlapConfig(layers)
    with pytest.raises(ConfigError, match="holds the settings of 'qkv_dgrad'"):
        OverlapConfig({**defaults, "qkv_fprop": defaults["qkv_dgrad"]})
    assert OverlapConfig(defaults.values()) == defaults
    with pytest.raises(ConfigError, match=r"unknown layer 'qkv'"):
        LayerSettings.default("qkv")


# --------------------------------------------------------------------------- effects / table
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rs_dgrad", [False, True])
def test_effects_cover_every_key(backend, rs_dgrad):
    cfg = OverlapConfig.load(None, rs_dgrad=rs_dgrad)
    for name in LAYER_NAMES:
        for effects in (cfg[name].effects(backend), cfg.effects(name, backend)):
            assert tuple(effects) == KEYS
            assert all(isinstance(v, str) and v for v in effects.values())
            assert all(v == "active" or re.match(r"(no effect|fallback|clamped)", v)
                       for v in effects.values())


def test_effects_reasons(defaults):
    ring, pipe, bulk = defaults["qkv_fprop"], defaults["proj_fprop"], defaults["qkv_wgrad"]
    p2p = ring.effects("torch_p2p")
    assert p2p["num_sm"] == "no effect on torch_p2p: NCCL picks its own SMs"
    assert p2p["num_splits"] == "no effect: ring_exchange uses TP chunks"
    assert p2p["fp8_buf"] == ("no effect: FP8 layers (config.fp8) gather FP8 and reduce bf16 "
                              "regardless")
    assert p2p["aggregate"] == "active" and p2p["gemm_priority"] == "active"
    assert pipe.effects("symm")["num_sm"] == "active"
    assert pipe.effects("symm")["num_splits"] == "active"
    assert pipe.effects("symm")["pipeline_rs_overlap_first_gemm"] == "active"
    assert pipe.effects("torch_p2p")["use_ce"].startswith("no effect")
    assert ring.effects("nvshmem")["use_ce"].startswith("no effect on nvshmem: host-initiated puts")
    no_ce = defaults.replace("qkv_fprop", use_ce=False)["qkv_fprop"]
    assert no_ce.effects("nvshmem")["num_sm"].startswith("no effect")
    assert pipe.effects("nvshmem")["num_sm"] == pipe.effects("symm")["num_sm"] == "active"
    assert defaults["proj_fprop"].effects("symm")["aggregate"].startswith("no effect")
    hot = defaults.replace("proj_fprop", comm_priority=2)["proj_fprop"]
    assert hot.effects("symm")["comm_priority"].startswith("clamped")
    atomic_bulk = dataclasses.replace(bulk, atomic_gemm=True)  # TE warns and drops it
    assert atomic_bulk.effects("symm")["atomic_gemm"] == \
        "fallback: non-atomic GEMM (TE ignores atomic_gemm for bulk)"
    assert bulk.effects("symm")["num_splits"].startswith("no effect: bulk")
    assert defaults["proj_wgrad"].effects("symm")["num_sm"].startswith(
        "no effect: external all-gathers on proj_dgrad's")
    with pytest.raises(ConfigError, match=r"unknown backend 'nvshmme' \(did you mean 'nvshmem'\?\)"):
        ring.effects("nvshmme")


def test_stream_priorities(defaults):
    assert defaults["qkv_fprop"].stream_priorities(0, -5) == (-5, 0)  # TE: comm high, gemm low
    s = defaults.replace("qkv_fprop", comm_priority=-9, gemm_priority=3)["qkv_fprop"]
    assert s.stream_priorities(0, -5) == (-5, 0)


def test_table_torch_p2p(defaults):
    text = defaults.table("torch_p2p", tp_size=8)
    for name in LAYER_NAMES:
        assert name in text
    for method in METHODS:
        assert method in text
    rows = {line.split()[0]: line for line in text.splitlines() if line.split()
            and line.split()[0] in LAYER_NAMES}
    assert rows["qkv_fprop"].split()[3] == "8" and rows["proj_fprop"].split()[3] == "4"
    for key in ("num_sm", "cga_size", "set_sm_margin"):
        assert re.search(rf"{key} \[.*\]: no effect on torch_p2p: NCCL picks its own SMs", text)
    notes = _notes_column(text, "qkv_fprop")
    assert "no effect:" in notes and all(k in notes for k in ("num_sm", "cga_size", "set_sm_margin"))
    assert "TP=8" in text and "tp_comm_overlap_rs_dgrad" not in text


def test_table_symm_and_rs_dgrad():
    cfg = OverlapConfig.load(None, rs_dgrad=True)
    text = cfg.table("symm")
    assert "num_sm" not in _notes_column(text, "proj_fprop")  # active on a pipeline layer
    assert "cga_size" in _notes_column(text, "proj_fprop")
    assert "unused while qkv_dgrad reduce-scatters" in text
    assert "tp_comm_overlap_rs_dgrad" in text  # notes are printed
    with pytest.raises(ConfigError, match="unknown backend 'nccl'; allowed backends: torch_p2p"):
        cfg.table("nccl")
    with pytest.raises(ConfigError, match="tp_size"):
        cfg.table("symm", tp_size=0)


def _notes_column(text: str, layer: str) -> str:
    """The wrapped notes cell of `layer`'s row: the text after the last column start."""
    lines = text.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("layer"))
    col = header.index("notes")
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [layer])
    cell = [lines[start][col:]]
    for line in lines[start + 1:]:
        if line[:col].strip():
            break
        cell.append(line[col:])
    return " ".join(part.strip() for part in cell).replace("_ ", "_")


# --------------------------------------------------------------------------- value semantics
def test_mapping_and_value_semantics(defaults):
    again = OverlapConfig.load(None)
    assert again == defaults and hash(again) == hash(defaults) and again is not defaults
    changed = defaults.replace("fc1_fprop", aggregate=True)
    assert changed != defaults and defaults["fc1_fprop"].aggregate == "auto"
    assert changed["fc1_fprop"].aggregate is True and len({defaults, again, changed}) == 2
    with pytest.raises(Exception):
        defaults["fc1_fprop"].num_sm = 3  # frozen
    assert dict(defaults.items())["qkv_fprop"] is defaults["qkv_fprop"]
    assert "1 layers differ" in repr(changed)


def test_config_layer_does_not_import_torch():
    root = pathlib.Path(__file__).resolve().parents[1] / "megatron_overlap" / "config"
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n.split(".")[0] == "torch" for n in names), path.name


def test_gemm_streams_is_our_key_written_only_off_its_default(defaults):
    assert all(defaults[name].gemm_streams == 0 for name in LAYER_NAMES)  # the global default
    assert "gemm_streams" not in yaml.safe_load(defaults.to_yaml())["fc1_fprop"]  # TE reads it
    cfg = defaults.replace("fc1_fprop", gemm_streams=2)
    assert yaml.safe_load(cfg.to_yaml())["fc1_fprop"]["gemm_streams"] == 2
    assert OverlapConfig.load(cfg.to_yaml()) == cfg
    assert cfg["fc1_fprop"].effects("symm")["gemm_streams"] == "active"
    assert cfg["qkv_dgrad"].effects("symm")["gemm_streams"].startswith("no effect: bulk")
    for bad in (-1, 9, 1.5, "two"):
        with pytest.raises(ConfigError, match=r"fc1_fprop.*gemm_streams.*0\.\.8"):
            OverlapConfig.load({"fc1_fprop": {"gemm_streams": bad}})


# --------------------------------------------------------------------------- registries
def test_backend_registry_is_the_one_list_of_backends():
    import importlib.util

    from megatron_overlap import comm
    from megatron_overlap.ab.backends import ORDER
    from megatron_overlap.config import COMPOSITE, INTER_BACKENDS, REGISTRY
    from megatron_overlap.config.effects import CAPS

    assert tuple(REGISTRY) == BACKENDS == comm.AVAILABLE == tuple(CAPS)
    assert INTER_BACKENDS == comm.INTER_BACKENDS == ("torch_p2p", "nvshmem")
    assert COMPOSITE == comm.COMPOSITE == ("hierarchical",)
    assert sorted(ORDER) == sorted(BACKENDS) and ORDER[-1] == "torch_p2p"  # GPU-only ones first
    for name in BACKENDS + COMPOSITE:  # one comm module per backend
        assert importlib.util.find_spec(f"megatron_overlap.comm.{name}") is not None, name
        assert comm.resolve_backend(name) == name
    with pytest.raises(ValueError, match="choose 'auto' or one of"):
        comm.resolve_backend("nccl")


def test_the_megatron_lm_flag_takes_the_registry_backends():
    """--tp-comm-overlap-backend (the entry point's flag and the source patch's) offers
    auto and every transport of the registry, no list of its own."""
    from megatron_overlap.config.backends import AUTO
    from megatron_overlap.megatron_lm import hooks

    assert hooks.BACKENDS == (AUTO,) + BACKENDS
    patch = (pathlib.Path(__file__).parents[1] / "patches" / "megatron-lm-core_v0.16.1.patch").read_text()
    # the patch is text applied to Megatron-LM's tree; it keeps a copy that must agree
    choices = re.search(r"'--tp-comm-overlap-backend'.*?\n\+\s*choices=(\[.*?\]),", patch)
    assert choices and tuple(ast.literal_eval(choices.group(1))) == hooks.BACKENDS


def test_buffer_names_live_once():
    from megatron_overlap.config import BUFFER_NAMES, COLUMN_BUFFERS, PASSES, ROW_BUFFERS
    from megatron_overlap.layers import plan
    from megatron_overlap.simulate import shapes

    assert sorted(COLUMN_BUFFERS + ROW_BUFFERS) == sorted(BUFFER_NAMES)
    assert LAYER_NAMES == tuple(f"{b}_{p}" for b in BUFFER_NAMES for p in PASSES)
    assert plan.BUFFER_NAMES is BUFFER_NAMES and shapes.BUFFERS is BUFFER_NAMES
    from megatron_overlap.ab import shapes as ab

    assert ab.ORDER == COLUMN_BUFFERS + ROW_BUFFERS  # the short shapes' order: column first
    assert [s.name.split("_")[2] for s in ab.SHORT[:4]] == list(ab.ORDER)


def test_reference_shapes_live_once():
    from megatron_overlap.ab import shapes as ab
    from megatron_overlap.simulate import REFERENCE

    assert [(s.name, s.m, s.k, s.n, s.tp) for s in ab.REFERENCE] == \
        [(s.name, s.m, s.k, s.n, s.tp) for s in REFERENCE.values()]
    assert [s.op for s in ab.REFERENCE] == ["ag" if s.column else "rs" for s in REFERENCE.values()]
    assert ab.BY_NAME["70B_tp8_fc1_2048"] == ab.Shape("70B_tp8_fc1_2048", 2048, 8192, 7168, "ag", 8)


def test_console_table_wraps_to_its_width():
    from megatron_overlap.config.console import Column, lines, table

    cols = [Column("name"), Column("ms", right=True), Column("notes", wrap=True, min_width=10)]
    rows = [("a", "1.5", "word " * 30), ("bb", "12.25", "short")]
    text = table("title", cols, rows, rules_after={0}, width=60)
    out = text.splitlines()
    assert out[0] == "title" and out[1] == "" and out[2].split() == ["name", "ms", "notes"]
    assert max(map(len, out)) <= 60 and all(line == line.rstrip() for line in out)
    assert out[4].startswith(" a       1.5  word word")  # right-justified numbers
    notes_at = out[2].index("notes")
    wrapped = [line for line in out[4:] if line[:notes_at].strip() == ""]
    assert " ".join(w.strip() for w in [out[4][notes_at:]] + wrapped).split() == ["word"] * 30
    assert sum(1 for line in out if set(line.strip()) == {"─"}) == 2  # header rule + one section
    assert out[-1].split() == ["bb", "12.25", "short"]
    assert lines("x", "y") == "x\ny\n"
    from megatron_overlap.config.console import wrapped

    notes = wrapped("word " * 30, "short", width=40)
    assert notes[-1] == "  short" and all(len(n) <= 40 for n in notes)
    assert notes[0].startswith("  word") and notes[1].startswith("    word")  # hanging indent
    assert " ".join(notes[:-1]).split() == ["word"] * 30
