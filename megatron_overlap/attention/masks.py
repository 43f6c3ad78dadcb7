"""Megatron's attention masks, as torch's fused attention takes them.

Megatron's DotProductAttention has two softmax paths: a fused CUDA kernel (with
`masked_softmax_fusion`, where its kernels are installed and the shapes fit), which applies
the causal mask itself and ignores a causal layer's mask tensor and any window, and the
unfused torch path, which every other case runs. We compute what the unfused path computes
(for a causal layer given its causal mask, both paths agree). It decides the mask in this
order, and so do we:
1. a layer with a sliding window (`config.window_size`, `window_attn_skip_freq`) masks
   outside the window, whatever else it is given: key j is seen by query i when
   i + (sk - sq) - left <= j <= i + (sk - sq) + right (aligned at the bottom right);
2. else a mask tensor, when one is given, is used as it is: True where masked, broadcast
   over [b, heads, sq, sk] (the constructor's mask type is not consulted);
3. else a causal layer with more than one query is causal, aligned at the bottom right when
   sq != sk (Megatron's own causal path asserts sq == sk; its window and decode paths align
   so);
4. else nothing is masked.

Megatron fills masked scores with -10000 before its softmax, so a query whose every key is
masked gets the mean of the values (a uniform softmax) and no query/key gradient; SDPA
would give zeros or NaN there. `MaskPlan.full_rows` marks those rows: they are unmasked for
the kernel (so it stays finite) and their output replaced by that mean.
"""

from __future__ import annotations

import functools
from typing import NamedTuple, Optional, Union

import torch
from torch.nn.attention.bias import CausalBias, causal_lower_right

Window = tuple[int, int]


def layer_window(config, layer_number: int) -> Optional[Window]:
    """The sliding window of layer `layer_number` (1-based), or None: megatron-core 0.15+
    skips the window on some layers (`window_attn_skip_freq`); 0.14 windows every layer."""
    if not getattr(config, "window_size", None):
        return None
    try:
        from megatron.core.transformer.utils import is_layer_window_attention
    except ImportError:  # megatron-core 0.14: no per-layer choice
        return tuple(config.window_size)
    skip = getattr(config, "window_attn_skip_freq", None)
    return tuple(config.window_size) if is_layer_window_attention(config.window_size, skip,
                                                                  layer_number) else None


def window_mask(sq: int, sk: int, window: Window, device: torch.device) -> torch.Tensor:
    """[sq, sk] bool, True where query i sees key j (SDPA's sense); a negative bound is
    unbounded (Transformer Engine's convention, e.g. (-1, 0) is plain causal; Megatron's
    unfused mask reads -1 literally, `support.notes` says so). Cached, every windowed layer of
    a model sharing it, except while a CUDA graph is captured (a tensor made then holds its
    values only once the graph replays)."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return _window_mask(sq, sk, window, device)
    return _cached_window_mask(sq, sk, window, device)


def empty_window_rows(sq: int, sk: int, window: Window) -> int:
    """How many leading queries see no key at all through the window (sq > sk + right):
    Megatron's softmax spreads them uniformly (module docstring)."""
    right = window[1]
    return max(0, sq - sk - right) if right >= 0 else 0


def _window_mask(sq: int, sk: int, window: Window, device: torch.device) -> torch.Tensor:
    left, right = window
    rel = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None] - (sk - sq)
    seen = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        seen &= rel >= -left
    if right >= 0:
        seen &= rel <= right
    return seen


_cached_window_mask = functools.lru_cache(maxsize=8)(_window_mask)


class MaskPlan(NamedTuple):
    """What SDPA gets: `attn_mask` (bool, True = attend; or a CausalBias), `is_causal`, and
    `full_rows` ([.., sq, 1] bool: queries Megatron's softmax would spread uniformly)."""

    attn_mask: Union[torch.Tensor, CausalBias, None]
    is_causal: bool
    full_rows: Optional[torch.Tensor]


def plan(attention_mask: Optional[torch.Tensor], causal: bool, window: Optional[Window],
         sq: int, sk: int, device: torch.device) -> MaskPlan:
    """The mask of one call, in Megatron's order (module docstring)."""
    if window is not None:
        seen, empty = window_mask(sq, sk, window, device), empty_window_rows(sq, sk, window)
        if not empty:
            return MaskPlan(seen, False, None)
        full = (torch.arange(sq, device=device) < empty)[:, None]
        return MaskPlan(seen | full, False, full)
    if attention_mask is not None:
        full = attention_mask.all(dim=-1, keepdim=True)  # rows with no key left
        return MaskPlan(~attention_mask | full, False, full)
    if causal and sq > 1:
        return MaskPlan(None, True, None) if sq == sk else MaskPlan(causal_lower_right(sq, sk), False, None)
    return MaskPlan(None, False, None)


def uniform_rows(out: torch.Tensor, value: torch.Tensor, full_rows: torch.Tensor) -> torch.Tensor:
    """`out` ([b, np, sq, hv]) with the rows in `full_rows` replaced by the mean of the
    values over the keys, as Megatron's softmax of an all-masked row gives; value:
    [b, ng, sk, hv] (query heads share key/value groups in blocks, as Megatron repeats)."""
    mean = value.mean(dim=2, keepdim=True)
    if mean.shape[1] != out.shape[1]:
        mean = mean.repeat_interleave(out.shape[1] // mean.shape[1], dim=1)
    return torch.where(full_rows, mean.to(out.dtype), out)
