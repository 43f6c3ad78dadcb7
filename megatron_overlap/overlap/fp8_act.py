"""A SwiGLU whose FP8 cast runs in its own kernel, as Transformer Engine's activations write
FP8: the forward's output quantized as fc2's input, the backward's input gradient as fc1's
output gradient. Without it each is written in bf16 by the SwiGLU, then read again by the
linear for its amax (current scaling) and again for its cast: at 8B TP=4 (8192 tokens) 336
and 616 MiB of traffic a step (forward, backward) where the fused kernels move 280 and 448
(current scaling: one pass for the amax, writing nothing, then the cast), or 280 and 504
against 168 and 280 (delayed scaling: the cast with the history's scale, its amax reduced
beside).

The numbers: the SwiGLU in float32 (`swiglu`, `swiglu_grad`: Megatron's swiglu and
swiglu_back, term for term), quantized from float32, where Megatron's SwiGLU rounds to
the parameters' dtype first. On CPU (and a GPU without Triton) the same functions run
eagerly, then `overlap.fp8`'s casts; on a GPU one Triton kernel reads y (and g) once per
pass (overlap/fp8_triton.py `swiglu_tile`).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import fp8, fp8_kernels


def _gate_up(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = y.to(torch.float32).chunk(2, dim=-1)
    return gate, up


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of y = [gate, up] (the last dim), in float32."""
    gate, up = _gate_up(y)
    return gate * torch.sigmoid(gate) * up


def swiglu_grad(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The gradient of `swiglu` at y for its output gradient g: [d gate, d up], float32."""
    gate, up = _gate_up(y)
    g, s = g.to(torch.float32), torch.sigmoid(gate)
    return torch.cat((g * s * (1.0 + gate * (1.0 - s)) * up, g * (gate * s)), dim=-1)


def _made(act: str, y: torch.Tensor, g: Optional[torch.Tensor]) -> torch.Tensor:
    x = swiglu(y) if act == "swiglu" else swiglu_grad(g, y)
    return x.reshape(-1, x.shape[-1])


def quantized(act: str, y: torch.Tensor, g: Optional[torch.Tensor], dtype: torch.dtype,
              pair: torch.Tensor, out: torch.Tensor, out_t: Optional[torch.Tensor] = None,
              chunks: Optional[tuple[int, int]] = None,
              state: Optional[fp8.AmaxHistory] = None,
              amax_out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`act` ('swiglu': of y; 'swiglu_grad': of g at y) quantized into `out` (2-D, rows
    chunk-major with `chunks`, `overlap.fp8.chunk_major`) and, with `out_t`, transposed
    there, its scale pair into `pair`: current scaling (`state` None) with the scale of
    its own amax (into `amax_out` where given); delayed scaling with `state`'s scale, its
    amax into `amax_out` (`overlap.fp8.delayed_quantize`'s contract)."""
    y, g = y.detach(), (None if g is None else g.detach())
    if state is not None and amax_out is None:
        raise ValueError(f"{act}: delayed scaling records the amax: amax_out is needed")
    args = (act, y, g, dtype, pair, out, out_t, chunks, state, amax_out)
    if not _fused(*args):
        _eager(*args)
    return out


def _fused(act: str, y: torch.Tensor, g: Optional[torch.Tensor], dtype: torch.dtype,
           pair: torch.Tensor, out: torch.Tensor, out_t: Optional[torch.Tensor],
           chunks: Optional[tuple[int, int]], state: Optional[fp8.AmaxHistory],
           amax_out: Optional[torch.Tensor]) -> bool:
    """`quantized` as the Triton kernels (overlap/fp8_kernels.py `run_act`: current scaling
    an amax launch, then the cast; delayed one cast); False where they do not run (CPU,
    `fp8.set_fused(False)`, tensors they do not take, no Triton)."""
    if not fp8._fusing or y.device.type != "cuda":
        return False
    capturing = torch.cuda.is_current_stream_capturing()
    kw = dict(o=out, ot=out_t, used=pair, chunks=chunks or (1, 1))
    if state is not None:
        return fp8_kernels.run_act(act, "delayed", capturing, y, g, amax_out, scale=state.scale,
                                   **kw)
    a = amax_out if amax_out is not None else torch.empty((), dtype=torch.float32,
                                                           device=y.device)
    return (fp8_kernels.run_act(act, "amax", capturing, y, g, a)
            and fp8_kernels.run_act(act, "current", capturing, y, g, a, **kw))


def _eager(act: str, y: torch.Tensor, g: Optional[torch.Tensor], dtype: torch.dtype,
           pair: torch.Tensor, out: torch.Tensor, out_t: Optional[torch.Tensor],
           chunks: Optional[tuple[int, int]], state: Optional[fp8.AmaxHistory],
           amax_out: Optional[torch.Tensor]) -> None:
    """`quantized`'s definition: the float32 SwiGLU, then `overlap.fp8`'s casts."""
    x = _made(act, y, g)
    if state is not None:
        fp8.delayed_quantize(x, state, dtype, pair, amax_out, out, out_t, chunks)
    else:
        fp8.quantize_current(x, fp8.amax(x, out=amax_out), dtype, pair, out, out_t, chunks)
