"""Inputs checked at the layer's door, before any transfer starts.

A refused input raises `LayerInputError` on the calling rank only, having touched
no transport: the next valid call works. Each message names the layer, what was
expected, what came and the fix. The empty sequence is no error: it gets the
empty result Megatron's own layer returns, computed without communication.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ..config import ConfigError, LayerSettings
from ..overlap import matmul
from .functions import token_rows
from .wgrad import grad_buffer, grad_for_autograd, weight_grad


class LayerInputError(ValueError):
    """An input an overlapped layer cannot take (the message says why and the fix)."""


def _fail(layer: Any, what: str, fix: str) -> LayerInputError:
    return LayerInputError(f"megatron_overlap: layer {layer.overlap_plan.layer!r}: {what}; {fix}")


def _common(layer: Any, x: Any, width: int, weight: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise _fail(layer, f"expected a torch.Tensor input, got {type(x).__name__}",
                    "pass the activations as a tensor")
    if x.dim() not in (2, 3):
        raise _fail(layer, f"expected a 3-D [sequence, batch, {width}] or 2-D [tokens, {width}] "
                    f"input, got {x.dim()}-D {tuple(x.shape)}",
                    "reshape it to [s, b, h] as Megatron's layers take")
    if x.shape[-1] != width:
        raise _fail(layer, f"expected a last (hidden) dimension of {width}, got "
                    f"{tuple(x.shape)}", f"give the layer inputs of width {width} (its "
                    "input_size, divided by TP for a row-parallel layer whose input is parallel)")
    if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
        raise _fail(layer, f"input dtype {x.dtype} does not match the weights' {weight.dtype}",
                    f"cast the input with .to({weight.dtype})")
    if x.device != weight.device:
        raise _fail(layer, f"input is on {x.device}, the weights on {weight.device}",
                    f"move the input with .to({str(weight.device)!r})")


def _splits(layer: Any, s: LayerSettings | None, rows: int, tp: int, where: str) -> None:
    """A pipelined GEMM->RS cuts `rows` (per rank) into num_splits chunks."""
    if s is None or s.method != "pipeline" or rows == 0:
        return
    n = s.splits(tp)
    if rows % n:
        raise _fail(layer, f"{s.name}: num_splits={n} does not divide the {rows} rows per rank "
                    f"of {where}", f"pick a num_splits that divides {rows} for {s.name}, or "
                    f"a sequence length x micro-batch size that {n} divides")


def megatron_fallback(layer: Any) -> str:
    """Why the layer runs Megatron's own forward whatever its plan says ('' when not)."""
    if getattr(layer, "explicit_expert_comm", False):
        return "explicit_expert_comm (MoE expert communication)"
    if getattr(layer.config, "defer_embedding_wgrad_compute", False):
        return "defer_embedding_wgrad_compute=True"
    return ""


def check_fp8_build(layer: Any) -> None:
    """An FP8 layer, when it is built: torchao there, a forward of ours (Megatron's runs
    bf16), and per-rank GEMM dimensions cuBLAS's FP8 GEMM takes (multiples of 16)."""
    from ..overlap.fp8 import available

    name, p = layer.overlap_plan.layer, layer.precision
    available()  # MissingExtra naming the [fp8] extra
    why = megatron_fallback(layer)
    if why:
        raise ConfigError(f"megatron_overlap: layer {name!r}: {why} makes the layer run "
                          f"Megatron's own forward, which runs bf16, while the config asks for "
                          f"{p.describe()}; turn {why.split('=')[0]} off or set fp8=None",
                          layer=name, key="fp8", value=p.recipe)
    n, k = layer.weight.shape
    if n % 16 or k % 16:
        raise ConfigError(f"megatron_overlap: layer {name!r}: {p.describe()} needs this rank's "
                          f"weight dimensions to be multiples of 16 (cuBLAS's FP8 GEMM), got "
                          f"{n} x {k}; pick hidden / FFN sizes (divided by TP) that 16 divides, "
                          f"or set fp8=None", layer=name, key="fp8", value=p.recipe)


def _fp8_tokens(layer: Any, tokens: int) -> None:
    """An FP8 wgrad multiplies over the tokens: their count must be a multiple of 16."""
    p = layer.precision
    if p.fp8 and p.wgrad and layer.weight.requires_grad and tokens % 16:
        raise _fail(layer, f"{p.describe()}: the wgrad GEMM runs over the {tokens} tokens "
                    "(sequence x micro-batch) of the whole sequence, which cuBLAS's FP8 GEMM "
                    "takes in multiples of 16", "pad the sequence so that 16 divides sequence "
                    "x micro-batch, or set fp8_wgrad=False")


def _fp8_rowwise_dtype(layer: Any, x: torch.Tensor) -> None:
    """A row-wise FP8 GEMM outputs bf16: the layer's activations must be bf16."""
    p = layer.precision
    if p.recipe == "rowwise" and x.dtype != torch.bfloat16:
        raise _fail(layer, f"{p.describe()}: torch's row-wise FP8 GEMM outputs bf16, and the "
                    f"input is {x.dtype}", "give the layer bf16 activations (bf16 parameters, "
                    "no autocast to another dtype)")


def check_column(layer: Any, x: Any, weight: torch.Tensor) -> None:
    """OverlapColumnParallelLinear's input: [s/tp (SP) or s, b, input_size] or 2-D."""
    _common(layer, x, layer.input_size, weight)
    plan, tp = layer.overlap_plan, layer.tp_group.size()
    if plan.sequence_parallel and plan.rs_dgrad:
        _splits(layer, plan.dgrad, token_rows(x), tp, "the dgrad's reduce-scatter")
    _fp8_tokens(layer, token_rows(x) * (tp if plan.sequence_parallel else 1))
    _fp8_rowwise_dtype(layer, x)


def check_row(layer: Any, x: Any) -> None:
    """OverlapRowParallelLinear's input: [s, b, input_size / tp] (input_is_parallel) or
    [s, b, input_size]; with SP the sequence is reduce-scattered, so TP divides s."""
    width = layer.input_size_per_partition if layer.input_is_parallel else layer.input_size
    _common(layer, x, width, layer.weight)
    plan, tp = layer.overlap_plan, layer.tp_group.size()
    if plan.sequence_parallel and x.shape[0] % tp:
        raise _fail(layer, f"sequence parallelism reduce-scatters the sequence over TP={tp}, "
                    f"and the input's sequence length {x.shape[0]} (shape {tuple(x.shape)}) "
                    f"is not a multiple of {tp}", f"pad the sequence to a multiple of {tp} "
                    "(Megatron's own layer refuses it too)")
    rows = token_rows(x) // tp if plan.sequence_parallel else token_rows(x)
    _splits(layer, plan.fprop, rows, tp, "the forward's reduce-scatter" if plan.sequence_parallel
            else "the forward's all-reduce")
    _fp8_tokens(layer, token_rows(x))
    _fp8_rowwise_dtype(layer, x)


def is_empty(x: torch.Tensor) -> bool:
    return token_rows(x) == 0


class EmptyLinear(torch.autograd.Function):
    """y = x @ W^T (+ b) for an input with no rows: the empty output, grads as
    Megatron's layer gives them (an empty input grad, zero weight / bias grads, or
    main_grad untouched under gradient_accumulation_fusion). No communication: every
    collective over no rows moves nothing."""

    @staticmethod
    def forward(ctx, x, weight, bias, out_rows: int, fuse_wgrad: bool):
        ctx.save_for_backward(x, weight)
        ctx.use_bias, ctx.fuse = bias is not None, fuse_wgrad
        return x.new_empty(out_rows, *x.shape[1:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        g = grad_out.reshape(-1, weight.shape[0])
        x2 = x.reshape(-1, x.shape[-1])
        trains = ctx.needs_input_grad[1]  # False: a frozen weight (no grad, main_grad left alone)
        grad_w = grad_buffer(weight, g, ctx.fuse, trains)
        if trains:
            weight_grad(weight, g, x2, ctx.fuse, functools.partial(matmul, op="wgrad"), grad_w)
        grad_w = grad_for_autograd(grad_w, weight, x, trains)
        grad_b = g.sum(0) if ctx.use_bias else None
        return x.new_zeros(x.shape), grad_w, grad_b, None, None


def empty_column(layer: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
    """The column layer's output for no rows: [s x tp (SP) or s, b, output_size / tp]."""
    sp = layer.overlap_plan.sequence_parallel
    out_rows = x.shape[0] * layer.tp_group.size() if sp else x.shape[0]
    return EmptyLinear.apply(x, weight, bias, out_rows, layer.gradient_accumulation_fusion)


def empty_row(layer: Any, x: torch.Tensor, bias: torch.Tensor | None):
    """The row layer's output for no rows: [s / tp (SP) or s, b, output_size]."""
    sp = layer.overlap_plan.sequence_parallel
    out_rows = x.shape[0] // layer.tp_group.size() if sp else x.shape[0]
    return EmptyLinear.apply(x, layer.weight, bias, out_rows, layer.gradient_accumulation_fusion)
