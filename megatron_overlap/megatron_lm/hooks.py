"""Hooks that turn megatron_overlap on inside an unmodified Megatron-LM.

They do, at the level of functions, what `patches/megatron-lm-core_v0.16.1.patch`
does by editing two files:

- `megatron.training.arguments.add_megatron_arguments` (which `parse_args` calls)
  also adds `--tp-comm-overlap-impl {te,megatron_overlap}` (default te: Megatron-LM's
  own Transformer Engine path) and `--tp-comm-overlap-backend`;
- `validate_args` (wherever Megatron-LM's modules bound it) also requires
  `--transformer-impl local` when `--tp-comm-overlap` runs on megatron_overlap, and
  `--tp-comm-overlap` with `--fp8-format` (FP8 runs in our linears only), and
  `--fp8-format` with `--fp8-recipe tensorwise` for `--megatron-overlap-fp8-scaling rowwise`;
- `megatron.training.initialize._initialize_tp_communicators` (which
  `initialize_megatron` calls for `--tp-comm-overlap`, before the model is built)
  calls `megatron_overlap.install(ub_cfgs=..., backend=...)` instead of building
  TE's Userbuffers.

`--tp-comm-overlap-impl megatron_overlap` without `--tp-comm-overlap` installs the
package with every overlap off: Megatron's own linears, and torch norms that accept
`--sequence-parallel` on the local spec without apex.

Either way the local spec's core attention becomes torch's fused attention
(`--megatron-overlap-attention torch`, the default; `megatron` keeps Megatron's
DotProductAttention, and so does `--attention-backend unfused`, which names Megatron's
unfused attention (`local` too, which Megatron-LM takes only with `--spec local`); auto,
flash and fused, Transformer Engine's names, run torch's fused kernels). With it, a dataloader's plain causal masks
(`--create-attention-mask-in-dataloader`, Megatron-LM's default, without
`--reset-attention-mask`) are not made: Megatron's causal mask type says the same, and
without a mask tensor the attention runs the causal flash / cuDNN kernels instead of a
masked one (2-4x slower on an H200).

`install_hooks()` checks every target first (present, expected parameters, called
where expected) and raises `UnsupportedMegatronLM`, naming the megatron-core
version and what is missing, before anything is changed.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

from ..config.backends import AUTO, BACKENDS as _TRANSPORTS
from ..config.names import FAST_ACCUM_DEFAULT, FAST_ACCUMS

IMPL = "megatron_overlap"
IMPLS = ("te", IMPL)
ATTENTION = ("torch", "megatron")  # --megatron-overlap-attention: install(attention=...)
# Megatron-LM's flags whose batches can be packed sequences (get_batch's cu_seqlens path)
PACKED = (("--sft", "sft"), ("--dataloader-inter-document-masking", "dataloader_inter_document_masking"))
FP8_SCALINGS = ("tensorwise", "rowwise")  # --megatron-overlap-fp8-scaling: install(fp8_scaling=)
FP8_FAST_ACCUMS = tuple(FAST_ACCUMS)  # --megatron-overlap-fp8-fast-accum: install(fp8_fast_accum=)
BACKENDS = (AUTO,) + _TRANSPORTS  # --tp-comm-overlap-backend: the registry's transports
ARGS_MODULE = "megatron.training.arguments"
INIT_MODULE = "megatron.training.initialize"


class UnsupportedMegatronLM(RuntimeError):
    """This Megatron-LM lacks a function the hooks need, or has it in another shape."""


@dataclass(frozen=True)
class Target:
    """A Megatron-LM function to wrap: `module.name(*params)`, looked up by its global
    name from at least one of `callers` (module, function) that exist."""

    module: str
    name: str
    params: tuple[str, ...]
    callers: tuple[tuple[str, str], ...]

    @property
    def qualname(self) -> str:
        return f"{self.module}.{self.name}({', '.join(self.params)})"


ADD_ARGUMENTS = Target(ARGS_MODULE, "add_megatron_arguments", ("parser",),
                       ((ARGS_MODULE, "parse_args"),))
VALIDATE = Target(ARGS_MODULE, "validate_args", ("args",),
                  ((INIT_MODULE, "initialize_megatron"), (ARGS_MODULE, "parse_and_validate_args")))
TP_INIT = Target(INIT_MODULE, "_initialize_tp_communicators", (),
                 ((INIT_MODULE, "initialize_megatron"),))
TARGETS = (ADD_ARGUMENTS, VALIDATE, TP_INIT)

_originals: dict[Target, Callable[..., Any]] = {}
_rebound: list[tuple[Any, str, Callable[..., Any]]] = []  # (module, attribute, original)
_off_installed: list[bool] = []


def megatron_core_version() -> str:
    try:
        from megatron.core.package_info import __version__
    except Exception as e:  # noqa: BLE001 - any failure here is reported as such
        return f"unknown ({type(e).__name__}: {e})"
    return str(__version__)


def _where() -> str:
    core = sys.modules.get("megatron.core")  # megatron/ itself is a namespace package
    path = os.path.dirname(os.path.dirname(os.path.dirname(core.__file__))) if core else "?"
    return f"Megatron-LM with megatron-core {megatron_core_version()} (at {path})"


def _import(name: str) -> Any:
    """The module, or None where this Megatron-LM has no such module (other import
    errors, such as a missing dependency, propagate as they are)."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        if e.name and (name == e.name or name.startswith(e.name + ".")):
            return None
        raise


def problems(target: Target) -> list[str]:
    """What keeps `target` from being hooked in the Megatron-LM on sys.path (empty: fine)."""
    module = _import(target.module)
    if module is None:
        return [f"module {target.module} is missing"]
    fn = getattr(module, target.name, None)
    if not inspect.isfunction(fn):
        return [f"{target.module}.{target.name} is missing"]
    required = [p.name for p in inspect.signature(fn).parameters.values()
                if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    errors = []
    if required != list(target.params):
        errors.append(f"{target.module}.{target.name} takes ({', '.join(required)}), "
                      f"expected ({', '.join(target.params)})")
    callers = [getattr(_import(m), f, None) for m, f in target.callers]
    if not any(inspect.isfunction(c) and target.name in c.__code__.co_names for c in callers):
        names = " or ".join(f"{m}.{f}" for m, f in target.callers)
        errors.append(f"{target.name} is not called from {names}")
    return errors


def check() -> None:
    """Raise UnsupportedMegatronLM listing every target this Megatron-LM cannot serve."""
    found = [p for t in TARGETS for p in problems(t)]
    if found:
        raise UnsupportedMegatronLM(
            f"megatron_overlap.megatron_lm cannot serve {_where()}: "
            + "; ".join(found)
            + ". It needs " + ", ".join(t.qualname for t in TARGETS)
            + " (Megatron-LM core_v0.14 to core_v0.19 and main have them). Nothing was changed; "
            "use megatron_overlap.install() from your own script, or patches/.")


_FLAGS = {  # flag -> its argparse keywords
    "--tp-comm-overlap-impl": dict(
        type=str, default="te", choices=IMPLS,
        help="Implementation of --tp-comm-overlap: te (Transformer Engine Userbuffers, TE "
        "layers) or megatron_overlap (Megatron-core's own layers: --transformer-impl local). "
        "megatron_overlap without --tp-comm-overlap: every overlap off, SP torch norms."),
    "--tp-comm-overlap-backend": dict(
        type=str, default="auto", choices=BACKENDS,
        help="Transport for --tp-comm-overlap-impl megatron_overlap."),
    "--megatron-overlap-attention": dict(
        type=str, default="torch", choices=ATTENTION,
        help="Core attention of the local spec's layers under --tp-comm-overlap-impl "
        "megatron_overlap: torch (torch's fused attention: flash / cuDNN / memory-efficient "
        "SDPA, varlen flash for packed sequences) or megatron (Megatron's "
        "DotProductAttention; so does --attention-backend unfused)."),
    "--megatron-overlap-fp8-scaling": dict(
        type=str, default="tensorwise", choices=FP8_SCALINGS,
        help="Scales of --fp8-recipe tensorwise in megatron_overlap's linears: tensorwise (one "
        "per tensor) or rowwise (one per row, torchao's rowwise with the wgrad in bf16: needs "
        "--no-fp8-wgrad and --bf16)."),
    "--megatron-overlap-fp8-fast-accum": dict(
        type=str, default=FAST_ACCUM_DEFAULT, choices=FP8_FAST_ACCUMS,
        help="FP8 GEMMs of megatron_overlap's linears that accumulate fast (torch's "
        "use_fast_accum): fprop (the forward GEMM, as Transformer Engine's recipes and torchao "
        "run it), none, or all (dgrad and wgrad too: faster, less exact)."),
    "--megatron-overlap-fp8-unfused-activation": dict(
        action="store_true",
        help="Keep Megatron's SwiGLU between FP8 fc1 and fc2 (bf16, then each linear's cast), "
        "where megatron_overlap's MLP writes fc2's FP8 input and fc1's FP8 output gradient in "
        "the SwiGLU's own kernel; for A/B runs."),
}


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Our flags, beside Megatron-LM's --tp-comm-overlap (each skipped when present, e.g. in
    a tree patched with patches/)."""
    have = parser._option_string_actions  # noqa: SLF001 - argparse has no public lookup
    missing = [flag for flag in _FLAGS if flag not in have]
    if missing:
        group = parser.add_argument_group("megatron_overlap", "tensor-parallel comm/GEMM "
                                          "overlap of Megatron-core's own linears "
                                          "(--transformer-impl local)")
        for flag in missing:
            group.add_argument(flag, **_FLAGS[flag])
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Our part of validate_args (Megatron-LM's own already requires
    --sequence-parallel for --tp-comm-overlap)."""
    scaling = getattr(args, "megatron_overlap_fp8_scaling", "tensorwise")
    fast = getattr(args, "megatron_overlap_fp8_fast_accum", FAST_ACCUM_DEFAULT)
    if getattr(args, "tp_comm_overlap_impl", "te") != IMPL:
        for flag, value, default, what in (
                ("--megatron-overlap-fp8-scaling", scaling, "tensorwise", "the scales"),
                ("--megatron-overlap-fp8-fast-accum", fast, FAST_ACCUM_DEFAULT,
                 "the FP8 accumulation")):
            if value != default:
                raise ValueError(f"{flag} {value} sets {what} of megatron_overlap's linears: it "
                                 "needs --tp-comm-overlap-impl megatron_overlap (Transformer "
                                 "Engine's layers do not read it)")
        return
    overlap = bool(getattr(args, "tp_comm_overlap", False))
    fp8 = getattr(args, "fp8", None)
    if fp8 and not overlap:
        raise ValueError(
            f"--fp8-format {fp8} with --tp-comm-overlap-impl megatron_overlap needs "
            "--tp-comm-overlap: FP8 runs in megatron_overlap's linears, and without "
            "--tp-comm-overlap Megatron-core's local linears are built, which run in the "
            "params dtype without Transformer Engine (and do not say so); add "
            "--tp-comm-overlap, or drop --fp8-format")
    if fast != FAST_ACCUM_DEFAULT and not fp8:
        raise ValueError(f"--megatron-overlap-fp8-fast-accum {fast} chooses the FP8 GEMMs that "
                         "accumulate fast: it needs --fp8-format")
    if scaling != "tensorwise" and (not fp8 or getattr(args, "fp8_recipe", None) != "tensorwise"):
        raise ValueError(
            f"--megatron-overlap-fp8-scaling {scaling} chooses the scales of FP8 current "
            "scaling: it needs --fp8-format and --fp8-recipe tensorwise (got --fp8-format "
            f"{fp8}, --fp8-recipe {getattr(args, 'fp8_recipe', None)})")
    if overlap and (getattr(args, "transformer_impl", "local") != "local"
                    or getattr(args, "use_legacy_models", False)):
        raise ValueError(
            "--tp-comm-overlap-impl megatron_overlap overlaps Megatron-core's own TP linears: "
            "use --transformer-impl local (TE layers need --tp-comm-overlap-impl te); got "
            f"--transformer-impl {args.transformer_impl}"
            + (" with --use-legacy-models" if getattr(args, "use_legacy_models", False) else ""))
    packed = [flag for flag, attr in PACKED if getattr(args, attr, False)
              and (attr != "sft" or _sft_packs())]
    kept = _megatron_attention(args)
    if packed and getattr(args, "transformer_impl", "local") == "local" and kept:
        raise ValueError(
            f"{packed[0]} packs documents into each sequence (THD, cu_seqlens), which "
            f"Megatron's DotProductAttention, kept by {kept}, refuses at the first step; "
            "torch's attention (--megatron-overlap-attention torch, the default) runs them")
    if _torch_attention(args) and getattr(args, "create_attention_mask_in_dataloader", False) \
            and not getattr(args, "reset_attention_mask", False):
        args.create_attention_mask_in_dataloader = False
        _say(args, "the dataloader's causal attention masks are not made (--no-create-attention-"
             "mask-in-dataloader): the causal mask type says the same, and torch's attention runs its "
             "causal kernels without them")
    if not overlap and not _off_installed:
        _install(args, ub_cfgs=None, why="every overlap off (no --tp-comm-overlap)")
        _off_installed.append(True)  # once, however often validate_args runs


def _torch_attention(args: argparse.Namespace) -> bool:
    """Whether the local spec's layers get torch's attention: the local transformer, and
    nothing that keeps Megatron's (`_megatron_attention`)."""
    return getattr(args, "transformer_impl", "local") == "local" and _megatron_attention(args) is None


def _megatron_attention(args: argparse.Namespace) -> str | None:
    """What keeps Megatron's DotProductAttention in every layer, or None: our flag
    (`--megatron-overlap-attention megatron`), an --attention-backend naming Megatron's
    own, or a model setting torch's kernels lack (`attention.support.unsupported`, read
    from the arguments of the same names)."""
    from ..attention.support import MEGATRON_BACKENDS, unsupported

    if getattr(args, "megatron_overlap_attention", "torch") != "torch":
        return "--megatron-overlap-attention megatron"
    backend = getattr(args, "attention_backend", None)
    name = getattr(backend, "name", str(backend))
    if name in MEGATRON_BACKENDS:
        return f"--attention-backend {name}"
    why = unsupported(args)
    return f"the model's {why}" if why else None


def _sft_packs() -> bool:
    """Whether this tree's --sft batches are packed sequences (its SFT dataset returns
    cu_seqlens: core_v0.16 on; core_v0.14's returns causal masks)."""
    try:
        from megatron.training.datasets import sft_dataset

        return "cu_seqlens" in inspect.getsource(sft_dataset.SFTDataset)
    except Exception:  # noqa: BLE001  (a tree whose SFT module does not import here: unknown)
        return False


def initialize_tp_communicators() -> None:
    """megatron_overlap.install() for --tp-comm-overlap-impl megatron_overlap, else
    Megatron-LM's own _initialize_tp_communicators (Transformer Engine)."""
    from megatron.training import get_args

    args = get_args()
    if not hasattr(args, "tp_comm_overlap_impl"):
        raise UnsupportedMegatronLM(
            f"{_where()}: the parsed arguments have no tp_comm_overlap_impl (did --yaml-cfg "
            "replace them?); megatron_overlap.megatron_lm will not guess between "
            "megatron_overlap and Transformer Engine")
    if args.tp_comm_overlap_impl != IMPL:
        _say(args, "--tp-comm-overlap-impl te: Transformer Engine Userbuffers (Megatron-LM's own)")
        return _originals[TP_INIT]()
    _install(args, ub_cfgs=args.tp_comm_overlap_cfg or None, why="--tp-comm-overlap")


def _install(args: argparse.Namespace, ub_cfgs: str | None, why: str) -> None:
    import megatron_overlap

    attention = getattr(args, "megatron_overlap_attention", "torch")
    scaling = getattr(args, "megatron_overlap_fp8_scaling", "tensorwise")
    fast = getattr(args, "megatron_overlap_fp8_fast_accum", FAST_ACCUM_DEFAULT)
    fused = not getattr(args, "megatron_overlap_fp8_unfused_activation", False)
    _say(args, f"megatron_overlap.install(ub_cfgs={ub_cfgs!r}, "
         f"backend={args.tp_comm_overlap_backend!r}, attention={attention!r}, "
         f"fp8_scaling={scaling!r}, fp8_fast_accum={fast!r}, "
         f"fp8_fused_activation={fused}): {why}")
    megatron_overlap.install(ub_cfgs=ub_cfgs, backend=args.tp_comm_overlap_backend,
                             attention=attention, fp8_scaling=scaling, fp8_fast_accum=fast,
                             fp8_fused_activation=fused)


def _say(args: argparse.Namespace, what: str) -> None:
    if int(getattr(args, "rank", os.environ.get("RANK", 0)) or 0) == 0:
        print(f"megatron_overlap.megatron_lm: {what} [{_where()}]", flush=True)


def _wrap_add_arguments(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def add_megatron_arguments(parser, *a, **k):
        return add_arguments(original(parser, *a, **k))
    return add_megatron_arguments


def _wrap_validate(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def validate_args(args, *a, **k):
        out = original(args, *a, **k)
        check_args(args)
        return out
    return validate_args


def _wrap_tp_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def _initialize_tp_communicators(*a, **k):
        return initialize_tp_communicators()
    return _initialize_tp_communicators


_WRAPPERS = {ADD_ARGUMENTS: _wrap_add_arguments, VALIDATE: _wrap_validate, TP_INIT: _wrap_tp_init}


def installed() -> bool:
    return bool(_originals)


def install_hooks() -> None:
    """Check every target, then wrap each one in every loaded megatron module that
    bound it by name (e.g. `from megatron.training.arguments import validate_args`)."""
    if installed():
        return
    check()
    for target in TARGETS:
        original = getattr(sys.modules[target.module], target.name)
        wrapped = _WRAPPERS[target](original)
        _originals[target] = original
        for module in [m for n, m in list(sys.modules.items())
                       if m is not None and (n == "megatron" or n.startswith("megatron."))]:
            if getattr(module, target.name, None) is original:
                setattr(module, target.name, wrapped)
                _rebound.append((module, target.name, original))


def uninstall_hooks() -> None:
    """Put back every function install_hooks() replaced."""
    while _rebound:
        module, name, original = _rebound.pop()
        setattr(module, name, original)
    _originals.clear()
    _off_installed.clear()
