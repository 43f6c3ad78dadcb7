"""Core attention on torch's fused kernels, in place of Megatron's DotProductAttention.

Megatron's local spec computes attention as baddbmm -> masked softmax -> bmm, building the
whole [b, heads, sq, sk] score matrix; `TorchDotProductAttention` computes the same function
with torch's fused attention (SDPA: cuDNN, flash or memory-efficient kernels, chosen by torch
per call; varlen flash attention for packed sequences) and takes everything Megatron gives
DotProductAttention. What it cannot run keeps Megatron's module, with the reason recorded
(`support.unsupported`). `install()` puts it into every layer built while installed
(`megatron.attention`).

Owns: Megatron's attention semantics (masks, windows, scale, dropout RNG, packed THD) mapped
onto torch's kernels. Knows nothing of the linears or the transports.
"""

from .core import TorchDotProductAttention, attention_row

__all__ = ["TorchDotProductAttention", "attention_row"]
