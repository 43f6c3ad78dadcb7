"""install() patches exactly two things (the TP linears' construction and torch
norms under SP) and uninstall() puts Megatron back as it was."""

from types import SimpleNamespace

import pytest
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer import torch_norm

import megatron_overlap as mo
from megatron_overlap.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear


def _norm_config(sp):
    return SimpleNamespace(layernorm_zero_centered_gamma=False, persist_layer_norm=False,
                           sequence_parallel=sp, memory_efficient_layer_norm=False,
                           normalization="RMSNorm")


def _megatron_state():
    return (ColumnParallelLinear.__dict__["__init__"], RowParallelLinear.__dict__["__init__"],
            torch_norm.WrappedTorchNorm.__dict__["__new__"])


def test_uninstall_restores_megatron_exactly():
    before = _megatron_state()
    mo.install()
    mo.install({"fc1_fprop": {"aggregate": True}})  # nested installs
    assert _megatron_state() != before
    mo.uninstall()
    assert _megatron_state() != before  # still installed once
    mo.uninstall()
    assert _megatron_state() == before
    with pytest.raises(AssertionError, match="sequence parallel not supported"):
        torch_norm.WrappedTorchNorm(_norm_config(True), 8)


def test_installed_torch_norms_accept_sequence_parallel_and_mark_params():
    mo.install()
    try:
        norm = torch_norm.WrappedTorchNorm(_norm_config(True), 8)
        plain = torch_norm.WrappedTorchNorm(_norm_config(False), 8)
    finally:
        mo.uninstall()
    assert [getattr(p, "sequence_parallel") for p in norm.parameters()] == [True]
    assert [getattr(p, "sequence_parallel") for p in plain.parameters()] == [False]
    cfg = _norm_config(True)
    mo.install()
    try:
        torch_norm.WrappedTorchNorm(cfg, 8)
    finally:
        mo.uninstall()
    assert cfg.sequence_parallel is True  # the config is handed back unchanged


def _sub(node):
    """A spec node's submodules: ModuleSpec.submodules, or (megatron-core 0.18+ MLPs)
    the `submodules` keyword of a functools.partial."""
    return node.submodules if hasattr(node, "submodules") else node.keywords["submodules"]


def test_overlap_layer_spec_swaps_the_four_linears_only():
    spec = get_gpt_layer_local_spec()
    ours = mo.overlap_layer_spec(spec)
    attn, mlp = _sub(ours.submodules.self_attention), _sub(ours.submodules.mlp)
    assert attn.linear_qkv is OverlapColumnParallelLinear
    assert attn.linear_proj is OverlapRowParallelLinear
    assert mlp.linear_fc1 is OverlapColumnParallelLinear
    assert mlp.linear_fc2 is OverlapRowParallelLinear
    # the input spec is untouched; everything else is the same object
    assert _sub(spec.submodules.self_attention).linear_qkv is ColumnParallelLinear
    assert _sub(spec.submodules.mlp).linear_fc2 is RowParallelLinear
    assert ours.submodules.self_attention.submodules.core_attention is attn.core_attention
    assert ours.submodules.input_layernorm is spec.submodules.input_layernorm


def test_install_takes_every_environment_knob_and_uninstall_restores_them(monkeypatch):
    from megatron_overlap import comm
    from megatron_overlap.comm.transport import default_timeout
    from megatron_overlap.overlap import replay, streams

    monkeypatch.setenv("MEGATRON_OVERLAP_GEMM_STREAMS", "3")
    monkeypatch.setenv("MEGATRON_OVERLAP_INTER_BACKEND", "torch_p2p")
    monkeypatch.setenv("MEGATRON_OVERLAP_GRAPHS", "1")
    monkeypatch.setenv("MEGATRON_OVERLAP_TIMEOUT_S", "45")
    replay.set_enabled(None)

    def knobs():
        return (replay.enabled(), streams.default_gemm_streams(), comm.inter_backend(),
                default_timeout().total_seconds())

    before = knobs()
    assert before == (True, 3, "torch_p2p", 45.0)  # the variables are the defaults
    mo.install(graphs=False, gemm_streams=2, inter_backend="nvshmem", timeout_s=7.5)
    try:
        assert knobs() == (False, 2, "nvshmem", 7.5)
        # a transport made now (at a layer's first forward) waits that long
        assert comm.NullTransport(2, 0).timeout.total_seconds() == 7.5
        mo.install(timeout_s=20)  # nested: the inner one wins, its uninstall gives it back
        assert knobs() == (True, 3, "torch_p2p", 20.0)
        mo.uninstall()
        assert knobs() == (False, 2, "nvshmem", 7.5)
    finally:
        mo.uninstall()
    assert knobs() == before
    assert comm.NullTransport(2, 0).timeout.total_seconds() == 45
    for kw, match in (({"graphs": "yes"}, "graphs"), ({"gemm_streams": 0}, "gemm_streams"),
                      ({"inter_backend": "symm"}, "inter_backend"), ({"timeout_s": 0}, "timeout_s"),
                      ({"timeout_s": -1}, "timeout_s"), ({"timeout_s": float("inf")}, "timeout_s"),
                      ({"timeout_s": float("nan")}, "timeout_s"), ({"timeout_s": "5"}, "timeout_s"),
                      ({"timeout_s": True}, "timeout_s"), ({"timeout_s": 8 * 24 * 3600}, "timeout_s")):
        with pytest.raises(ValueError, match=match):
            mo.install(**kw)
        assert knobs() == before
        assert not mo.config.state.installed()


def test_every_environment_variable_has_an_install_keyword():
    """Each MEGATRON_OVERLAP_* variable config.env reads is also an install() keyword of
    the same name (lower case, without the prefix); the variable is its default."""
    import inspect

    from megatron_overlap.config import env
    from megatron_overlap.megatron.install import install

    names = {v for k, v in vars(env).items() if k.isupper() and isinstance(v, str)
             and v.startswith("MEGATRON_OVERLAP_")}
    assert len(names) == 4, names
    params = inspect.signature(install).parameters
    for name in names:
        kw = name.removeprefix("MEGATRON_OVERLAP_").lower()
        assert kw in params and params[kw].default is None, (name, kw)
