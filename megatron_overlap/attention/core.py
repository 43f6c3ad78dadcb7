"""TorchDotProductAttention: Megatron's DotProductAttention, computed by torch's fused
attention instead of a materialised [b, heads, sq, sk] score matrix.

It is a DotProductAttention (a subclass: isinstance checks, spec slots and the empty
state dict stay Megatron's; checkpoints move both ways) with its own constructor, which
takes what megatron-core 0.14-0.19 and main give the core attention: `pg_collection` or
`model_comm_pgs`, `cp_comm_type`, and MLA's `k_channels` / `v_channels` (Megatron's own
class has no MLA slot). A config it cannot run (`support.unsupported`) turns the object
back into Megatron's class, built by Megatron's constructor, with the reason kept in
`megatron_overlap_attention` for the report.

Numerics against Megatron's unfused softmax path: the same masks (`masks`), the same
softmax scale (with `apply_query_key_layer_scaling` Megatron divides the scores by the
layer number and multiplies them back inside an fp32 softmax: the same product, which we
apply once), the softmax in fp32 in every fused kernel (`attention_softmax_in_fp32` has no
lower-precision path to select here). Attention dropout draws from Megatron's CUDA RNG
tracker, forked per TP rank as Megatron does without sequence parallelism, and is off in
eval; the dropped positions differ from Megatron's (another kernel's random stream).
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ..config.console import say_once
from . import masks, packed, support

_CAUSAL = ("causal",)  # the mask type whose default (no mask tensor) Megatron makes causal
# in a pack, attention is causal per document for these (Megatron's own class runs no packs;
# Transformer Engine's meaning)
_PACKED_CAUSAL = ("causal", "padding_causal", "causal_bottom_right")


def _tp_size(groups: Any) -> int:
    tp = getattr(groups, "tp", None) if groups is not None else None
    return tp.size() if tp is not None else parallel_state.get_tensor_model_parallel_world_size()


class TorchDotProductAttention(DotProductAttention):
    """Core attention on torch's fused kernels (SDPA; varlen flash attention for packed
    sequences). Input [sq, b, heads, dim] (packed: [tokens, heads, dim]); output
    [sq, b, heads * v_dim] (packed: [tokens, heads * v_dim]), as Megatron's."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: AttnMaskType,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None, cp_comm_type: Optional[str] = None,
                 pg_collection: Any = None, model_comm_pgs: Any = None) -> None:
        why = support.unsupported(config)
        if why is not None:  # Megatron's own, built by its constructor (as this version takes it)
            support.check_megatron_runs(config, k_channels, v_channels, layer_number, why)
            self.__class__ = DotProductAttention
            kwargs = {"attention_dropout": attention_dropout, "softmax_scale": softmax_scale,
                      "cp_comm_type": cp_comm_type}
            if pg_collection is not None:
                kwargs["pg_collection"] = pg_collection
            if model_comm_pgs is not None:
                kwargs["model_comm_pgs"] = model_comm_pgs
            # Megatron's own constructor, also while install() hooks it (megatron.attention)
            build = getattr(DotProductAttention.__init__, "__wrapped__", DotProductAttention.__init__)
            build(self, config, layer_number, attn_mask_type, attention_type, **kwargs)
            self.megatron_overlap_attention = why
            say_once(logging.WARNING, f"megatron_overlap: layer {max(1, layer_number)} keeps Megatron's "
                     f"DotProductAttention: {why}")
            return
        MegatronModule.__init__(self, config=config)
        groups = pg_collection if pg_collection is not None else model_comm_pgs
        self.pg_collection = groups
        tp_group = getattr(groups, "tp", None) if groups is not None else None
        self.tp_group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
        tp = _tp_size(groups)
        self.layer_number = max(1, layer_number)
        self.name = f"layer {self.layer_number} core attention"
        self.attn_mask_type, self.attention_type, self.cp_comm_type = attn_mask_type, attention_type, cp_comm_type
        self.k_channels = k_channels or config.kv_channels
        self.v_channels = v_channels or config.kv_channels
        self.num_attention_heads_per_partition = self._divide(config.num_attention_heads, tp, "num_attention_heads")
        self.num_query_groups_per_partition = self._divide(config.num_query_groups, tp, "num_query_groups")
        self.hidden_size_per_partition = self.num_attention_heads_per_partition * self.v_channels
        # the product Megatron's scores get (layer scaling divides, then its softmax multiplies back)
        self.softmax_scale = (1.0 / math.sqrt(self.k_channels)) if softmax_scale is None else softmax_scale
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.window = masks.layer_window(config, layer_number)  # (Megatron decides on the raw number)
        self.softmax_offset = None
        self.ran: set[str] = set()  # the kernel paths this layer has taken (the report's "ran")
        self.notes = support.notes(config, self.window)
        for note in self.notes:
            say_once(logging.WARNING, f"megatron_overlap: core attention: {note}")

    # -- forward ---------------------------------------------------------------------------
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: Optional[torch.Tensor], attn_mask_type: Optional[AttnMaskType] = None,
                attention_bias: Optional[torch.Tensor] = None, packed_seq_params: Any = None) -> torch.Tensor:
        """Megatron's signature; `attn_mask_type` is not consulted, as Megatron's
        DotProductAttention does not consult it (the constructor's type and the mask decide)."""
        if attention_bias is not None:
            raise ValueError(f"{self.name}: attention_bias is not supported (Megatron's "
                             "DotProductAttention refuses it too)")
        p = self.dropout_p if self.training else 0.0
        with self._dropout_rng(p):
            if packed_seq_params is not None:
                if attention_mask is not None:
                    raise ValueError(f"{self.name}: packed sequences take their documents from "
                                     "packed_seq_params; a mask tensor beside them is not supported")
                out, how = packed.attend(query, key, value, packed_seq_params,
                                         causal=self.attn_mask_type.name in _PACKED_CAUSAL,
                                         window=self.window, scale=self.softmax_scale, dropout_p=p,
                                         layer=self.name)
                self.ran.add(how)
                return out.reshape(out.shape[0], -1)
            return self._dense(query, key, value, attention_mask, p)

    def _dense(self, query, key, value, attention_mask, p: float) -> torch.Tensor:
        sq, b, heads = query.shape[:3]
        sk = key.shape[0]
        gqa = heads != key.shape[2]
        if (self.window is not None and p == 0.0 and packed.flash_takes(query, key, value)
                and not masks.empty_window_rows(sq, sk, self.window)):
            self.ran.add("varlen window")  # flash with window bounds: no [sq, sk] mask in memory
            out = packed.varlen_batch(query, key, value, self.window, self.softmax_scale, gqa)
            return out.view(b, sq, -1).transpose(0, 1).contiguous()
        plan = masks.plan(attention_mask, self.attn_mask_type.name in _CAUSAL, self.window, sq, sk,
                          query.device)
        self.ran.add("sdpa" if plan.attn_mask is None else "sdpa masked")
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, dim]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.attn_mask, dropout_p=p,
                                             is_causal=plan.is_causal, scale=self.softmax_scale,
                                             enable_gqa=gqa)
        if plan.full_rows is not None:
            out = masks.uniform_rows(out, v, plan.full_rows)
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _dropout_rng(self, p: float):
        """Megatron's RNG for attention dropout: the TP-rank fork of its CUDA RNG tracker
        without sequence parallelism, the default generator with it."""
        if p > 0.0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()

    def _divide(self, n: int, tp: int, what: str) -> int:
        if n % tp:
            raise ValueError(f"{self.name}: {what}={n} is not divisible by the tensor-parallel size {tp}")
        return n // tp


def attention_row(module: torch.nn.Module) -> Optional[dict[str, Any]]:
    """The report's row of a core-attention module (None for any other module): which
    implementation runs, and why where it is Megatron's."""
    if isinstance(module, TorchDotProductAttention):
        return {"impl": "torch", "mask": module.attn_mask_type.name, "window": module.window,
                "heads": f"{module.num_attention_heads_per_partition}:{module.num_query_groups_per_partition}",
                "dropout": module.dropout_p, "ran": ", ".join(sorted(module.ran)) or "-",
                "reason": "; ".join(module.notes)}
    if isinstance(module, DotProductAttention):
        why = getattr(module, "megatron_overlap_attention", "built while megatron_overlap was not installed")
        return {"impl": "megatron", "mask": module.attn_mask_type.name,
                "window": getattr(getattr(module, "scale_mask_softmax", None), "window_size", None),
                "heads": f"{module.num_attention_heads_per_partition}:{module.num_query_groups_per_partition}",
                "dropout": module.attention_dropout.p, "ran": "unfused", "reason": why}
    return None
