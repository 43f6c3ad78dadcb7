"""The precision an overlapped linear runs in, decided once when it is built, from
Megatron's own config fields (`fp8`, `fp8_recipe`, `fp8_wgrad`, `first_last_layers_bf16`
and its counts), with Transformer Engine's meaning.

Without TE, megatron-core's `get_fp8_context` is a null context: a model configured
for FP8 trains in bf16 and nothing says so. Here a setting either runs as configured
or is refused when the layer is built (`ConfigError` naming the layer, the setting
and what does run); it is never replaced by bf16 in silence. A layer Megatron keeps
in bf16 (`first_last_layers_bf16`) runs bf16 by that rule, said in its `why`.

Which FP8 GEMMs accumulate fast (torch's use_fast_accum) is not a Megatron field either
(Transformer Engine keeps it in its recipes: the forward's fast, the dgrad's and wgrad's
promoted to fp32, as torchao's Float8Linear): `install(fp8_fast_accum=...)`, by default
'fprop', as they do (`Precision.fast`, named in `describe()`).

Row-wise scaling is not one of Megatron's recipes (its `Fp8Recipe`: delayed, tensorwise,
mxfp8, blockwise, custom; Megatron-LM's --fp8-recipe takes no other). It is chosen
here, for layers whose config asks for current scaling (fp8_recipe='tensorwise'):
`install(fp8_scaling='rowwise')` (`set_scaling`), Megatron-LM's
`--megatron-overlap-fp8-scaling rowwise`.

The layer number comes from the TransformerLayer being built around the linear
(`building(layer)`, which the integration wraps around `TransformerLayer.__init__`),
the same global 1-based number Megatron passes `get_fp8_context` (less one).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch

from ..config import ConfigError
from ..config.names import FAST_ACCUM_DEFAULT, FAST_ACCUMS, fast_accum_label

RUNS = ("tensorwise", "delayed")  # the fp8_recipe values the overlapped linears run
SCALINGS = ("tensorwise", "rowwise")  # what fp8_recipe='tensorwise' runs: install(fp8_scaling=)
# what install() chooses beside Megatron's fields, for layers built from now on: the
# scales of fp8_recipe='tensorwise' (fp8_scaling) and the FP8 GEMMs that accumulate fast
# (fp8_fast_accum: a key of config.names.FAST_ACCUMS); the allowed values, then the chosen
CHOICES = {"fp8_scaling": SCALINGS, "fp8_fast_accum": tuple(FAST_ACCUMS)}
_chosen = {"fp8_scaling": "tensorwise", "fp8_fast_accum": FAST_ACCUM_DEFAULT}
_NOT_RUN = {  # fp8_recipe -> why it is refused
    "mxfp8": "MXFP8 needs block scales (32 values per scale, Blackwell GEMMs)",
    "blockwise": "blockwise scaling needs 128-value block scales",
    "custom": "a custom recipe is a Transformer Engine quantizer factory",
    "rowwise": "'rowwise' is not a Megatron recipe (Megatron-LM's --fp8-recipe refuses it, and "
               "with Transformer Engine installed megatron-core's get_fp8_context raises on it); "
               "row-wise scales are chosen with megatron_overlap.install(fp8_scaling='rowwise') "
               "(--megatron-overlap-fp8-scaling rowwise) on fp8_recipe='tensorwise'",
}
_FIX = ("set fp8_recipe='tensorwise' (--fp8-recipe tensorwise) or 'delayed', or fp8=None to "
        "train in bf16 "
        "(with tp_comm_overlap=False megatron-core's local linears also run bf16, "
        "without saying so)")
_enclosing: contextvars.ContextVar[Any] = contextvars.ContextVar("megatron_overlap_layer",
                                                                  default=None)


def check_choice(key: str, value: str, who: str = "megatron_overlap") -> None:
    """ValueError unless `value` is one of CHOICES[key] (`key`: an install() keyword)."""
    if value not in CHOICES[key]:
        raise ValueError(f"{who}: {key} must be one of {CHOICES[key]}, not {value!r}")


def choose(key: str, value: str) -> str:
    """Choose `value` for the install() keyword `key` (a key of CHOICES) for layers built
    from now on; returns the previous value."""
    check_choice(key, value)
    previous, _chosen[key] = _chosen[key], value
    return previous


def chosen(key: str) -> str:
    return _chosen[key]


def set_scaling(scaling: str) -> str:
    """The scales fp8_recipe='tensorwise' runs: 'tensorwise' (one per tensor) or 'rowwise'."""
    return choose("fp8_scaling", scaling)


@dataclass(frozen=True)
class Precision:
    """What a layer's GEMMs run in. `recipe` None: the parameters' dtype (bf16)."""

    recipe: Optional[str] = None
    fwd: Optional[torch.dtype] = None  # the input's and the weight's FP8 type
    grad: Optional[torch.dtype] = None  # the output gradient's (e5m2 under 'hybrid')
    wgrad: bool = False  # the wgrad GEMM in FP8 too (fp8_wgrad)
    why: str = ""  # for a bf16 layer of an FP8 model: the setting that keeps it in bf16
    # delayed scaling: amaxes kept per tensor, how the scale reads them, its margin
    history: int = 0  # fp8_amax_history_len
    algo: str = ""  # fp8_amax_compute_algo: 'max' or 'most_recent'
    margin: int = 0  # fp8_margin: the scale divided by 2^margin
    dp_amax: bool = False  # tp_only_amax_red=False asked data-parallel ranks too: not done
    fast: tuple[str, ...] = ()  # the FP8 GEMMs ('fprop', 'dgrad', 'wgrad') accumulated fast

    @property
    def fp8(self) -> bool:
        return self.recipe is not None

    def fast_accum(self, gemm: str) -> bool:
        """Whether the FP8 GEMM `gemm` ('fprop', 'dgrad' or 'wgrad') accumulates fast."""
        return gemm in self.fast

    def describe(self) -> str:
        if not self.fp8:
            return "bf16" + (f" ({self.why})" if self.why else "")
        name = lambda d: str(d).removeprefix("torch.float8_")  # noqa: E731
        delayed = (f", amax history {self.history} ({self.algo}), margin {self.margin}, "
                   f"amaxes reduced over the TP group"
                   + (" only (not over data-parallel ranks, which tp_only_amax_red=False asks)"
                      if self.dp_amax else "")) if self.recipe == "delayed" else ""
        return (f"fp8 {self.recipe} ({name(self.fwd)} fprop, {name(self.grad)} grads, "
                f"wgrad {'fp8' if self.wgrad else 'high precision'}{delayed}, "
                f"{fast_accum_label(self.fast)})")


BF16 = Precision()


@contextlib.contextmanager
def building(layer: Any) -> Iterator[None]:
    """Linears built inside are `layer`'s (a TransformerLayer: its `layer_number`)."""
    token = _enclosing.set(layer)
    try:
        yield
    finally:
        _enclosing.reset(token)


def enclosing_layer_number() -> Optional[int]:
    """The global 1-based number of the TransformerLayer being built, or None."""
    return getattr(_enclosing.get(), "layer_number", None)


def _refuse(layer: str, key: str, value: Any, why: str, fix: str) -> ConfigError:
    return ConfigError(f"megatron_overlap: layer {layer!r}: {key}={value!r}: {why}; {fix}",
                       layer=layer, key=key, value=value)


def _value(v: Any) -> Any:
    return getattr(v, "value", v)  # megatron's Fp8Recipe is a str enum


def _keeps_bf16(config: Any, layer_number: int) -> bool:
    """Megatron's own rule (fp8_utils.is_first_last_bf16_layer, global 0-based index;
    megatron-core 0.14 has the same rule inline in get_fp8_context)."""
    try:
        from megatron.core.fp8_utils import is_first_last_bf16_layer
    except ImportError:
        start = config.num_layers_at_start_in_bf16
        end = config.num_layers_at_end_in_bf16
        n = layer_number - 1
        return n < start or n >= config.num_layers - end
    return is_first_last_bf16_layer(config, layer_number - 1)


def layer_precision(config: Any, layer: str, layer_number: Optional[int] = None) -> Precision:
    """The precision of the linear `layer` (its name, for messages) built from `config`,
    inside transformer layer `layer_number` (global, 1-based; None: not known). Raises
    ConfigError for a setting the overlapped linears cannot honour."""
    if getattr(config, "fp4", None):
        raise _refuse(layer, "fp4", config.fp4, "FP4 is not implemented in the overlapped "
                      "linears (megatron-core runs it through Transformer Engine only)",
                      "set fp4=None, or tp_comm_overlap=False with Transformer Engine's spec")
    if getattr(config, "use_kitchen", False):
        raise _refuse(layer, "use_kitchen", True, "the kitchen quantization extension replaces "
                      "the linears itself", "set use_kitchen=False or tp_comm_overlap=False")
    fmt = getattr(config, "fp8", None)
    if not fmt:
        return BF16
    if fmt not in ("e4m3", "hybrid"):
        raise _refuse(layer, "fp8", fmt, "the FP8 formats are 'e4m3' and 'hybrid'",
                      "set fp8='e4m3' or fp8='hybrid'")
    recipe = _value(getattr(config, "fp8_recipe", "delayed"))
    if recipe not in RUNS:
        why = _NOT_RUN.get(recipe, "not an FP8 recipe the overlapped linears know")
        raise _refuse(layer, "fp8_recipe", recipe, f"{why}. The recipes that run: "
                      f"{', '.join(RUNS)}", _FIX)
    for key, default, why in (
            ("fp8_param", False, "FP8 parameters are Transformer Engine's Float8Tensor weights; "
                                 "the overlapped linears keep their weights in the params "
                                 "dtype and quantize them at each forward"),
            ("fp8_dot_product_attention", False, "the local spec's core attention runs in the "
                                                 "params dtype"),
            ("fp8_multi_head_attention", False, "the local spec's attention runs in the params "
                                                "dtype"),
            *(() if recipe == "delayed" else _DELAYED_ONLY)):
        value = getattr(config, key, default)
        if value != default:
            raise _refuse(layer, key, value, why, f"set {key}={default!r}")
    if getattr(config, "first_last_layers_bf16", False):
        if layer_number is None:
            raise _refuse(layer, "first_last_layers_bf16", True,
                          "this linear was built outside a TransformerLayer (or without "
                          "megatron_overlap.install()), so its layer number is unknown",
                          "build the model after install(), or set first_last_layers_bf16=False")
        if _keeps_bf16(config, layer_number):
            return Precision(why=f"first_last_layers_bf16: layer {layer_number} of "
                             f"{config.num_layers} (the first "
                             f"{config.num_layers_at_start_in_bf16} and last "
                             f"{config.num_layers_at_end_in_bf16} run bf16)")
    grad = torch.float8_e5m2 if fmt == "hybrid" else torch.float8_e4m3fn
    wgrad = bool(getattr(config, "fp8_wgrad", True))
    if recipe == "delayed":
        p = _delayed(config, layer, grad, wgrad)
    else:
        if _chosen["fp8_scaling"] == "rowwise":
            _check_rowwise(config, layer, wgrad)
            recipe = "rowwise"
        p = Precision(recipe, torch.float8_e4m3fn, grad, wgrad)
    return dataclasses.replace(p, fast=FAST_ACCUMS[_chosen["fp8_fast_accum"]])


_DELAYED_ONLY = (
    ("fp8_margin", 0, "only delayed scaling reads it (as in Transformer Engine); "
                      "tensorwise takes each scale from the current amax"),
    ("fp8_amax_history_len", 1, "only delayed scaling keeps an amax history"),
    ("fp8_amax_compute_algo", "most_recent", "only delayed scaling reads it"))
_RECOMPUTED = ("mlp", "moe", "shared_experts", "mla_up_proj")  # recompute_modules with linears


def _delayed(config: Any, layer: str, grad: torch.dtype, wgrad: bool) -> Precision:
    """Delayed scaling with Megatron's fields, or the setting that cannot run refused."""
    if _chosen["fp8_scaling"] == "rowwise":
        raise _refuse(layer, "fp8_recipe", "delayed", "row-wise scales "
                      "(install(fp8_scaling='rowwise'), --megatron-overlap-fp8-scaling rowwise) "
                      "are current scaling's; delayed scaling keeps one scale per tensor",
                      "set fp8_recipe='tensorwise' for row-wise scales, or fp8_scaling="
                      "'tensorwise' for delayed scaling")
    history = getattr(config, "fp8_amax_history_len", 1)
    algo = getattr(config, "fp8_amax_compute_algo", "most_recent")
    margin = getattr(config, "fp8_margin", 0)
    for key, value, ok, what in (
            ("fp8_amax_history_len", history, isinstance(history, int) and history >= 1,
             "a positive number of amaxes"),
            ("fp8_amax_compute_algo", algo, algo in ("max", "most_recent"),
             "'max' or 'most_recent'"),
            ("fp8_margin", margin, isinstance(margin, int) and margin >= 0,
             "a non-negative integer")):
        if not ok:
            raise _refuse(layer, key, value, f"delayed scaling takes {what}",
                          f"set {key} to {what}")
    granularity = getattr(config, "recompute_granularity", None)
    modules = getattr(config, "recompute_modules", None) or ["core_attn"]
    if granularity == "full" or (granularity == "selective"
                                 and any(m in _RECOMPUTED for m in modules)):
        what = "full" if granularity == "full" else f"selective {list(modules)}"
        raise _refuse(layer, "fp8_recipe", "delayed", f"with activation recompute ({what}) "
                      "the linears' forward runs twice: delayed scaling would record each "
                      "amax twice and quantize the recomputation with the scale updated in "
                      "between (Transformer Engine saves and restores its scaling state around "
                      "a recomputation; that is not implemented here)",
                      "set fp8_recipe='tensorwise' (current scaling recomputes the same "
                      "numbers), or recompute only core_attn")
    return Precision("delayed", torch.float8_e4m3fn, grad, wgrad, history=history,
                     algo=algo, margin=margin,
                     dp_amax=not getattr(config, "tp_only_amax_red", False))


def _check_rowwise(config: Any, layer: str, wgrad: bool) -> None:
    """What row-wise scaling cannot run, refused naming what does."""
    if wgrad:
        raise _refuse(layer, "fp8_wgrad", True, "row-wise scaling runs the wgrad GEMM in the "
                      "parameters' dtype (torchao's rowwise_with_gw_hp): the wgrad sums over "
                      "tokens, so per-token scales do not factor out of it, and an FP8 wgrad "
                      "would need the tensors quantized again along the tokens (under sequence "
                      "parallelism, with amaxes over the TP group)", "set fp8_wgrad=False "
                      "(--no-fp8-wgrad), or fp8_scaling='tensorwise' for an FP8 wgrad")
    dtype = getattr(config, "params_dtype", torch.float32)
    if dtype != torch.bfloat16:
        raise _refuse(layer, "params_dtype", dtype, "torch's row-wise FP8 GEMM outputs bf16 "
                      "only (its CUTLASS kernel in most torch versions, hipBLASLt), and the "
                      "layer's outputs are in the parameters' dtype", "set params_dtype="
                      "torch.bfloat16 (--bf16), or fp8_scaling='tensorwise'")
