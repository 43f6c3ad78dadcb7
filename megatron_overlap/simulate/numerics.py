"""What a linear's passes compute and move in, as the layers run them (docs/fp8.md):
the parameters' dtype, or FP8 (Megatron's `fp8`: 'hybrid' or 'e4m3'; `fp8_recipe`
'tensorwise', with `install(fp8_scaling=...)` 'tensorwise' or 'rowwise', or 'delayed';
`fp8_wgrad`).

Per pass of an FP8 linear:

| pass | GEMM | column layer moves | row layer moves |
|---|---|---|---|
| fprop | FP8 | the FP8 input (gather) | its output (reduce-scatter) |
| dgrad | FP8 | the wgrad's input (gather: FP8 if the wgrad is) | the FP8 gradient (gather) |
| wgrad | FP8 if fp8_wgrad | the dgrad's output (reduce-scatter) | nothing |

Reductions move the parameters' dtype, as does a column dgrad's reduce-scatter (rs_dgrad).

Row-wise, an FP8 GEMM's first operand carries each row's scale in a 16-byte tail
(`overlap.fp8.TAIL`), gathered with it; its wgrad runs in the parameters' dtype.
Bytes per element are the torch dtypes' own (`DTYPES`: the one table).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..config.names import FAST_ACCUM_DEFAULT, FAST_ACCUMS, fast_accum_label
from ..overlap.fp8 import TAIL

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
PARAM_DTYPES = ("bf16", "fp16", "fp32")
FP8_FORMATS = ("hybrid", "e4m3")  # Megatron's fp8
# fp8_recipe 'tensorwise' (install(fp8_scaling=): 'tensorwise' or 'rowwise') or 'delayed'
FP8_SCALINGS = ("tensorwise", "rowwise", "delayed")


def dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


@dataclass(frozen=True)
class Numerics:
    """One linear's precision. `fp8` None: everything in `dtype` (the parameters')."""

    dtype: str = "bf16"
    fp8: str | None = None
    scaling: str = "tensorwise"
    fp8_wgrad: bool = True
    # install(fp8_fast_accum=): the FP8 GEMMs accumulated fast (the GEMMs' speed is measured:
    # `tune` times each pass with it; the model itself reads no difference)
    fast_accum: str = FAST_ACCUM_DEFAULT

    def __post_init__(self) -> None:
        if self.dtype not in PARAM_DTYPES:
            raise ValueError(f"parameters' dtype {self.dtype!r}: one of {', '.join(PARAM_DTYPES)}")
        if self.fp8 is not None and self.fp8 not in FP8_FORMATS:
            raise ValueError(f"fp8 {self.fp8!r}: one of {', '.join(FP8_FORMATS)} (Megatron's "
                             "fp8 formats the overlapped linears run)")
        if self.fast_accum not in FAST_ACCUMS:
            raise ValueError(f"fp8 fast accumulation {self.fast_accum!r}: one of "
                             f"{', '.join(FAST_ACCUMS)}")
        if self.scaling not in FP8_SCALINGS:
            raise ValueError(f"fp8 scaling {self.scaling!r}: one of {', '.join(FP8_SCALINGS)}")
        if self.scaling == "rowwise":
            why = ("needs an FP8 format (fp8 hybrid or e4m3)" if self.fp8 is None else
                   "runs the wgrad in the parameters' dtype (fp8_wgrad off)" if self.fp8_wgrad
                   else "needs bf16 parameters (the row-wise FP8 GEMM outputs bf16)"
                   if self.dtype != "bf16" else "")
            if why:
                raise ValueError(f"row-wise FP8 scaling {why}")

    @property
    def params(self) -> torch.dtype:
        """Outputs, partial sums, reductions and every GEMM not in FP8."""
        return DTYPES[self.dtype]

    @property
    def fwd(self) -> torch.dtype | None:
        return DTYPES["e4m3"] if self.fp8 else None

    @property
    def grad(self) -> torch.dtype | None:
        return DTYPES["e5m2" if self.fp8 == "hybrid" else "e4m3"] if self.fp8 else None

    @property
    def wgrad_fp8(self) -> bool:
        return self.fp8 is not None and self.fp8_wgrad

    def gemm_dtype(self, pass_name: str) -> torch.dtype:
        """The first operand's dtype of the pass's GEMM (FP8: its scaled GEMM)."""
        if not self.fp8 or (pass_name == "wgrad" and not self.fp8_wgrad):
            return self.params
        return self.fwd if pass_name == "fprop" else self.grad  # type: ignore[return-value]

    def tail(self, pass_name: str) -> int:
        """Bytes each row of the GEMM's first operand carries after its values."""
        fp8 = self.gemm_dtype(pass_name).itemsize == 1
        return TAIL if fp8 and self.scaling == "rowwise" else 0

    @property
    def input_gather(self) -> torch.dtype:
        """What a column layer's backward gathers of its input for the wgrad."""
        return self.fwd if self.wgrad_fp8 else self.params  # type: ignore[return-value]

    def label(self) -> str:
        if not self.fp8:
            return self.dtype
        return (f"fp8 {self.fp8} {self.scaling} ({self.dtype} parameters, wgrad "
                f"{'fp8' if self.fp8_wgrad else self.dtype}, "
                f"{fast_accum_label(FAST_ACCUMS[self.fast_accum])})")

    def to_dict(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "fp8": self.fp8,
                "fp8_scaling": self.scaling if self.fp8 else None,
                "fp8_wgrad": self.wgrad_fp8,
                "fp8_fast_accum": self.fast_accum if self.fp8 else None, "label": self.label()}


BF16 = Numerics()


def yaml_comment(label: str) -> str:
    """The line a settings YAML picked for precision `label` begins with."""
    return f"# picked for precision: {label}\n"
