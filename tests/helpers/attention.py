"""Core-attention cases: TorchDotProductAttention against Megatron's DotProductAttention
(its unfused softmax path) on the same query, key, value and mask, forward and input
grads. Shared by tests/test_attention.py (CPU, fp32) and tests/gpu/test_attention_gpu.py
(bf16, fp16, windows on CUDA)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Optional

import torch

from megatron_overlap.ab.compare import rel_error


@dataclass(frozen=True)
class Case:
    name: str
    heads: int = 8
    groups: int = 8
    kv_channels: int = 16
    mask_type: str = "causal"
    mask: Optional[str] = None  # None | "causal" | "bottom_right" | "random" | "random_full_row"
    ref_mask: Optional[str] = None  # Megatron's mask where it differs (it asserts sq == sk causal)
    sq: int = 24
    sk: Optional[int] = None
    batch: int = 2
    softmax_scale: Optional[float] = None
    layer_scaling: bool = False
    layer_number: int = 1
    window: Optional[tuple] = None
    extra: dict = field(default_factory=dict, hash=False)


CASES = [
    Case("causal_no_mask_mha"),
    Case("causal_no_mask_gqa", groups=2),
    Case("causal_no_mask_mqa", groups=1),
    Case("causal_mask_tensor_gqa", groups=2, mask="causal"),
    Case("no_mask", mask_type="no_mask"),
    Case("no_mask_mqa", mask_type="no_mask", groups=1),
    Case("padding_random", mask_type="padding", mask="random", groups=2),
    Case("padding_fully_masked_rows", mask_type="padding", mask="random_full_row", groups=2),
    Case("arbitrary_random_mqa", mask_type="arbitrary", mask="random", groups=1),
    Case("softmax_scale", softmax_scale=0.37, groups=2),
    Case("layer_scaling", layer_scaling=True, layer_number=3, groups=2),
    Case("kv_channels_not_hidden_over_heads", kv_channels=24, groups=4),
    Case("head_dim_256", kv_channels=256, heads=4, groups=2, sq=16),
    Case("sq_lt_sk_bottom_right_mask", sq=8, sk=20, mask="bottom_right", groups=2),
    Case("decode_one_query", sq=1, sk=20, groups=2),
    # causal with sq != sk and no mask: Megatron's alignment, given to Megatron as a mask
    Case("causal_sq_lt_sk_no_mask", sq=8, sk=20, groups=2, ref_mask="bottom_right"),
    Case("cross_no_mask_sq_ne_sk", mask_type="no_mask", sq=12, sk=20),
    Case("window_causal", window=(5, 0), groups=2),
    Case("window_sq_lt_sk", window=(6, 0), sq=10, sk=20),
    Case("window_two_sided", window=(3, 2), mask_type="no_mask"),
    Case("window_queries_without_keys", window=(4, 0), sq=20, sk=8),  # the first 12 see none
]


def config(case: Case, dtype: torch.dtype = torch.float32, tp: int = 1, **extra):
    from megatron.core.transformer import TransformerConfig

    kwargs = dict(
        num_layers=4, hidden_size=64, num_attention_heads=case.heads, num_query_groups=case.groups,
        kv_channels=case.kv_channels, tensor_model_parallel_size=tp, use_cpu_initialization=True,
        attention_dropout=0.0, masked_softmax_fusion=False, params_dtype=dtype,
        bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        apply_query_key_layer_scaling=case.layer_scaling, softmax_scale=case.softmax_scale,
        window_size=case.window)
    return TransformerConfig(**{**kwargs, **case.extra, **extra})


def inputs(case: Case, dtype: torch.dtype, device: str, tp: int = 1, seed: int = 0, which=None):
    """query [sq, b, np, hn], key / value [sk, b, ng, hn] and Megatron's mask (True = masked):
    `which` (default the case's `mask`) names it."""
    g = torch.Generator().manual_seed(seed)
    sk = case.sk or case.sq
    np_, ng = case.heads // tp, case.groups // tp
    q = torch.randn(case.sq, case.batch, np_, case.kv_channels, generator=g)
    k = torch.randn(sk, case.batch, ng, case.kv_channels, generator=g)
    v = torch.randn(sk, case.batch, ng, case.kv_channels, generator=g)
    mask, which = None, case.mask if which is None else which
    if which == "causal":
        mask = torch.triu(torch.ones(case.sq, sk), diagonal=1).bool()[None, None]
    elif which == "bottom_right":
        mask = torch.triu(torch.ones(case.sq, sk), diagonal=1 + sk - case.sq).bool()[None, None]
    elif which in ("random", "random_full_row"):
        mask = torch.rand(case.batch, 1, case.sq, sk, generator=g) < 0.4
        if which == "random_full_row":
            mask[0, 0, 3] = True  # a query with no key left (padding)
            mask[1, 0, -1] = True
    out = [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v)]
    return (*out, None if mask is None else mask.to(device))


def run(module, q, k, v, mask, seed: int = 7, **kwargs):
    """module(q, k, v, mask) and its input grads for one fixed output gradient."""
    from helpers.megatron_cpu import cuda_tensors_on_cpu

    for t in (q, k, v):
        t.grad = None
    # Megatron makes its causal and window masks on 'cuda': on CPU they are made there
    ctx = cuda_tensors_on_cpu() if q.device.type == "cpu" else contextlib.nullcontext()
    with ctx:
        out = module(q, k, v, mask, **kwargs)
    g = torch.Generator().manual_seed(seed)
    dy = torch.randn(out.shape, generator=g).to(device=out.device, dtype=out.dtype)
    out.backward(dy)
    return [t.detach().float().clone() for t in (out, q.grad, k.grad, v.grad)]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return rel_error(a, b, dtype=torch.promote_types(a.dtype, b.dtype))


def compare(case: Case, dtype: torch.dtype, device: str, tp: int = 1) -> dict[str, float]:
    """Relative error of ours against Megatron's: output, dq, dk, dv."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_overlap.attention import TorchDotProductAttention

    cfg = config(case, dtype, tp)
    mt = AttnMaskType[case.mask_type]
    # as Megatron's Attention builds it: the config's softmax_scale passed along
    ref = DotProductAttention(cfg, case.layer_number, mt, "self", softmax_scale=case.softmax_scale)
    ours = TorchDotProductAttention(cfg, case.layer_number, mt, "self", softmax_scale=case.softmax_scale)
    assert type(ours) is TorchDotProductAttention, getattr(ours, "megatron_overlap_attention", "")
    q, k, v, mask = inputs(case, dtype, device, tp)
    ref_mask = mask if case.ref_mask is None else inputs(case, dtype, device, tp, which=case.ref_mask)[3]
    want = run(ref, q, k, v, ref_mask)
    got = run(ours, q, k, v, mask)
    return {name: rel(a, b) for name, a, b in zip(("out", "dq", "dk", "dv"), got, want)}
