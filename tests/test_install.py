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
    from megatron_overlap.overlap import replay, streams

    monkeypatch.setenv("MEGATRON_OVERLAP_GEMM_STREAMS", "3")
    monkeypatch.setenv("MEGATRON_OVERLAP_INTER_BACKEND", "torch_p2p")
    monkeypatch.setenv("MEGATRON_OVERLAP_GRAPHS", "1")
    replay.set_enabled(None)
    before = (replay.enabled(), streams.default_gemm_streams(), comm.inter_backend())
    assert before == (True, 3, "torch_p2p")  # the variables are the defaults
    mo.install(graphs=False, gemm_streams=2, inter_backend="nvshmem")
    try:
        assert (replay.enabled(), streams.default_gemm_streams(), comm.inter_backend()) == (
            False, 2, "nvshmem")
    finally:
        mo.uninstall()
    assert (replay.enabled(), streams.default_gemm_streams(), comm.inter_backend()) == before
    for kw, match in (({"graphs": "yes"}, "graphs"), ({"gemm_streams": 0}, "gemm_streams"),
                      ({"inter_backend": "symm"}, "inter_backend")):
        with pytest.raises(ValueError, match=match):
            mo.install(**kw)
        assert (replay.enabled(), streams.default_gemm_streams(), comm.inter_backend()) == before
        assert not mo.config.state.installed()
