"""Megatron's MLP with its SwiGLU fused with the FP8 casts around it (`layers.fp8_act`):
while installed, an `MLP` built with our FP8 fc1 and fc2 becomes `OverlapMLP` (the same
module, parameters and state dict) where its activation is one the fused kernel computes
as Megatron does: a SwiGLU (gated_linear_unit, silu) without bias, clamp, offset, FP8
input store or CPU offload, both linears scaling per tensor (tensorwise or delayed) with
FP8 wgrads. Each such MLP is reported once at construction; `install(fp8_fused_activation=
False)` keeps Megatron's SwiGLU (in bf16, then each linear's cast), for A/B runs."""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP

from ..config.console import say_once

_original_init = None
_enabled = True


def check(enabled: Any) -> None:
    """install(fp8_fused_activation=)'s value, checked before install() sets anything."""
    if not isinstance(enabled, bool):
        raise ValueError(f"megatron_overlap.install: fp8_fused_activation must be True or "
                         f"False, not {enabled!r}")


def set_enabled(enabled: bool) -> bool:
    """Whether MLPs built from now on fuse their SwiGLU with the FP8 casts (a value `check`
    passed); returns the previous setting."""
    global _enabled
    before, _enabled = _enabled, enabled
    return before


def why_not_fused(mlp: Any) -> Optional[str]:
    """Why `mlp`'s SwiGLU cannot run fused with its linears' FP8 casts, or None."""
    from ..layers import OverlapColumnParallelLinear, OverlapRowParallelLinear

    fc1, fc2, c = getattr(mlp, "linear_fc1", None), getattr(mlp, "linear_fc2", None), mlp.config
    if not (isinstance(fc1, OverlapColumnParallelLinear)
            and isinstance(fc2, OverlapRowParallelLinear)):
        return "its linears are not both megatron_overlap's"
    for fc in (fc1, fc2):
        p = fc.precision
        if not p.fp8 or p.recipe not in ("tensorwise", "delayed") or not p.wgrad:
            return (f"{fc.overlap_plan.layer} runs {p.describe()}: the fused casts need FP8 "
                    f"with per-tensor scales and an FP8 wgrad")
    if not (c.gated_linear_unit and mlp.activation_func is F.silu):
        return "its activation is not a SwiGLU"
    if fc1.bias is not None or not fc1.skip_bias_add:
        return "fc1 has a bias (add_bias_linear)"
    if getattr(c, "activation_func_clamp_value", None) is not None:
        return f"activation_func_clamp_value={c.activation_func_clamp_value!r}"
    for field in ("use_te_activation_func", "glu_linear_offset",
                  "activation_func_fp8_input_store", "cpu_offloading"):
        if getattr(c, field, None):  # (each off: False, None or 0)
            return f"{field}={getattr(c, field)!r}"
    if not fc2.input_is_parallel:
        return "fc2's input is not split over the TP ranks"
    return None


class OverlapMLP(MLP):
    """MLP whose SwiGLU writes fc2's FP8 input, and whose backward writes fc1's FP8 output
    gradient, in one kernel each (`layers.fp8_act.SwiGLUFp8`). A call with a per-token
    scale (MoE's) or an empty input runs Megatron's forward; other keywords (a padding
    mask) Megatron's dense MLP ignores, and so does this one."""

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any):
        from ..layers.fp8_act import SwiGLUFp8

        # (megatron-core's MLP.forward(hidden_states, per_token_scale=None, **kwargs); the
        # call passed on as it came, for versions without that argument)
        per_token_scale = args[0] if args else kwargs.get("per_token_scale")
        if per_token_scale is not None or hidden_states.numel() == 0:
            return super().forward(hidden_states, *args, **kwargs)
        y, _ = self.linear_fc1(hidden_states)
        a = SwiGLUFp8.apply(y, self.linear_fc1, self.linear_fc2, torch.is_grad_enabled())
        return self.linear_fc2(a)


def _building_init(original):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if type(self) is not MLP or not getattr(self.config, "fp8", None):
            return
        why = why_not_fused(self) if _enabled else "install(fp8_fused_activation=False)"
        if why is None:
            self.__class__ = OverlapMLP
            say_once(logging.INFO, "megatron_overlap: the MLPs' SwiGLU writes fc2's FP8 input "
                     "and fc1's FP8 output gradient itself (the casts fused into it)")
        else:
            say_once(logging.INFO, f"megatron_overlap: an MLP keeps Megatron's SwiGLU (its "
                     f"output cast to FP8 by fc2, its gradient by fc1): {why}")

    __init__.__wrapped__ = original
    return __init__


def patch() -> None:
    global _original_init
    if _original_init is None:
        _original_init = MLP.__dict__["__init__"]
        MLP.__init__ = _building_init(_original_init)


def unpatch() -> None:
    global _original_init
    if _original_init is not None:
        MLP.__init__ = _original_init
        _original_init = None
