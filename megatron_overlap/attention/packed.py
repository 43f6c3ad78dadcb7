"""Packed sequences (THD): several documents in one sequence, attention within each.

Megatron's fine-tuning data path packs documents and passes `PackedSeqParams` (qkv_format
'thd', cumulative sequence lengths `cu_seqlens_q/kv`, their maxima, and optionally
`*_padded` offsets where documents are padded apart); query, key and value arrive as
[tokens, heads, dim]. Megatron's DotProductAttention refuses them.

Two ways, the same function:
- varlen: torch's flash attention over variable-length documents
  (`torch.nn.attention.varlen.varlen_attn`): no mask in memory, GQA without repeating
  keys and values, causal and sliding windows through its window bounds. CUDA only, and
  without dropout. (On an H200, 4 documents per 16384 tokens: 2.3 ms forward + backward,
  against 3.5 ms for SDPA causal over the whole sequence and 13.3 ms for SDPA with the
  same mask as a tensor; FlexAttention with a document block mask 2.5 ms, and it needs
  torch.compile: benchmarks/results/probe_attention_h200.json.)
- masked: SDPA over the whole pack with a document mask built on the device from the
  cumulative lengths (no host sync); on CPU (torch's varlen and FlexAttention have no CPU
  backward) and with attention dropout.

Causal attention aligns within each document at its bottom right (flash's convention,
Megatron's alignment too). Documents padded apart (`cu_seqlens_*_padded`) run with the
padded boundaries: a document's tokens then see only their own document and, for a causal
mask, never the padding after them; the padding tokens' outputs are zeroed, so nothing
flows back from them into the documents. Without a causal mask the padding would be seen:
refused.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

import torch
import torch.nn.functional as F

from .masks import Window

try:  # torch >= 2.10
    from torch.nn.attention import varlen as _varlen

    _VARLEN_ARGS = set(inspect.signature(_varlen.varlen_attn).parameters)
except (ImportError, AttributeError):  # pragma: no cover - older torch
    _varlen, _VARLEN_ARGS = None, set()


def flash_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's varlen flash attention runs these tensors: CUDA on an Ampere or newer
    GPU, fp16 or bf16, one head dim for queries, keys and values (MLA's differ), a multiple
    of 8 up to 256, and a torch whose varlen takes window bounds (2.11 does; GQA is native
    there, 2.13 asks for `enable_gqa`). Anything else takes the SDPA paths."""
    d = q.shape[-1]
    return (q.is_cuda and "window_size" in _VARLEN_ARGS and q.dtype in (torch.float16, torch.bfloat16)
            and k.shape[-1] == d == v.shape[-1] and d % 8 == 0 and d <= 256
            and torch.cuda.get_device_capability(q.device) >= (8, 0))


def _varlen_call(q, k, v, cu_q, cu_k, max_q: int, max_k: int, bounds: Window, scale: float,
                 gqa: bool) -> torch.Tensor:
    gqa_flag = {"enable_gqa": gqa} if "enable_gqa" in _VARLEN_ARGS else {}
    return _varlen.varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale,
                               window_size=tuple(bounds), **gqa_flag)


def boundaries(params: Any, causal: bool, tokens: int, layer: str
               ) -> tuple[torch.Tensor, torch.Tensor, int, int, Optional[torch.Tensor]]:
    """(cu_q, cu_kv, max_q, max_kv, the query tokens that are documents' and not padding,
    or None where nothing is padded) of a pack: the padded offsets where given (module
    docstring), refused without a causal mask. A missing maximum is read from the device
    (one sync)."""
    if getattr(params, "qkv_format", "thd") != "thd":
        raise ValueError(f"{layer}: packed_seq_params with qkv_format={params.qkv_format!r}: torch's "
                         "attention takes packed sequences as 'thd' only")
    cu_q, cu_kv, valid = params.cu_seqlens_q, params.cu_seqlens_kv, None
    padded_q = getattr(params, "cu_seqlens_q_padded", None)
    padded_kv = getattr(params, "cu_seqlens_kv_padded", None)
    if (padded_q is not None and padded_q is not cu_q) or (padded_kv is not None and padded_kv is not cu_kv):
        if not causal:
            raise ValueError(f"{layer}: packed documents padded apart (cu_seqlens_*_padded) without a "
                             "causal mask would attend to the padding: pack them without padding, or "
                             "use a causal mask type")
        if padded_q is not None:
            valid = _valid(cu_q, padded_q, tokens)
            cu_q = padded_q
        cu_kv = padded_kv if padded_kv is not None else cu_kv
        # the given maxima may be the unpadded ones: bound the padded documents without a sync
        return cu_q, cu_kv, tokens, tokens, valid
    max_q, max_kv = params.max_seqlen_q, params.max_seqlen_kv
    if max_q is None:
        max_q = int((cu_q[1:] - cu_q[:-1]).max())
    if max_kv is None:
        max_kv = int((cu_kv[1:] - cu_kv[:-1]).max())
    return cu_q, cu_kv, int(max_q), int(max_kv), valid


def _valid(cu: torch.Tensor, padded: torch.Tensor, tokens: int) -> torch.Tensor:
    """[tokens] bool: the tokens of a padded pack that lie inside their document's length
    (computed on the device: no sync)."""
    i = torch.arange(tokens, device=padded.device)
    doc = _document_of(padded, i)
    return (i - padded[doc]) < (cu[doc + 1] - cu[doc])


def _document_of(cu: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """The document of each token index in `i`; tokens past the last boundary (trailing
    padding) belong to the last document."""
    return torch.searchsorted(cu[1:].contiguous(), i, right=True).clamp_(max=cu.numel() - 2)


def document_mask(cu_q: torch.Tensor, cu_kv: torch.Tensor, tq: int, tk: int, causal: bool,
                  window: Optional[Window]) -> torch.Tensor:
    """[tq, tk] bool, True where a query sees a key: the same document, and inside the
    causal / window bounds relative to that document's bottom-right corner."""
    dev = cu_q.device
    iq, ik = torch.arange(tq, device=dev), torch.arange(tk, device=dev)
    doc_q, doc_k = _document_of(cu_q, iq), _document_of(cu_kv, ik)
    same = doc_q[:, None] == doc_k[None, :]
    if not (causal or window):
        return same
    # key position minus query position, each from its document's end (bottom-right aligned)
    rel = (ik - cu_kv[doc_k + 1])[None, :] - (iq - cu_q[doc_q + 1])[:, None]
    left, right = window if window is not None else (-1, 0)
    if left >= 0:
        same &= rel >= -left
    if right >= 0:
        same &= rel <= right
    return same


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, params: Any, *, causal: bool,
           window: Optional[Window], scale: float, dropout_p: float, layer: str) -> tuple[torch.Tensor, str]:
    """Attention of a pack: q [tq, np, hk], k [tk, ng, hk], v [tk, ng, hv] ->
    ([tq, np, hv], the way it ran: 'varlen' or 'masked')."""
    cu_q, cu_kv, max_q, max_kv, valid = boundaries(params, causal, q.shape[0], layer)
    gqa = q.shape[1] != k.shape[1]
    if flash_takes(q, k, v) and dropout_p == 0.0:
        bounds = window if window is not None else ((-1, 0) if causal else (-1, -1))
        out = _varlen_call(q, k, v, cu_q.to(torch.int32), cu_kv.to(torch.int32), max_q, max_kv, bounds,
                           scale, gqa)
        how = "varlen"
    else:
        mask = document_mask(cu_q, cu_kv, q.shape[0], k.shape[0], causal, window)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                             v.transpose(0, 1)[None], attn_mask=mask, dropout_p=dropout_p,
                                             scale=scale, enable_gqa=gqa)[0].transpose(0, 1)
        how = "masked"
    if valid is not None:  # padding between documents: no output, so no gradient into them
        out = out * valid[:, None, None].to(out.dtype)
    return out, how


def varlen_batch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, window: Window,
                 scale: float, gqa: bool) -> torch.Tensor:
    """A batch of equal sequences ([s, b, heads, dim]) through varlen flash attention with
    window bounds: each sequence one document. Returns [b * sq, heads, v_dim]."""
    sq, b = query.shape[:2]
    sk = key.shape[0]
    q, k, v = (t.transpose(0, 1).reshape(-1, *t.shape[2:]) for t in (query, key, value))
    cu_q = torch.arange(0, b * sq + 1, sq, device=q.device, dtype=torch.int32)
    cu_k = torch.arange(0, b * sk + 1, sk, device=q.device, dtype=torch.int32)
    return _varlen_call(q, k, v, cu_q, cu_k, sq, sk, window, scale, gqa)
