"""OverlapConfig: the twelve LayerSettings of a transformer layer, checked
together for TE's cross-layer rules, and written back as TE ub_cfgs."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import yaml

from .errors import ConfigError, listed, unknown_key, unknown_layer
from .loading import parse
from .names import AG_RS_PAIRS, KEYS, LAYER_NAMES, RS_DGRAD_LAYERS, wgrad_of
from .settings import LayerSettings

_YAML_HEADER = ("# Tensor-parallel comm+GEMM overlap settings, in Transformer Engine's ub_cfgs\n"
                "# format (megatron_overlap). Every key is explicit, but `aggregate` where it is\n"
                "# auto (ours; TE, which would refuse it, then reads false).\n")


class OverlapConfig(Mapping[str, LayerSettings]):
    """Immutable mapping layer name -> LayerSettings, one per name in LAYER_NAMES."""

    __slots__ = ("_layers", "_notes")

    def __init__(self, layers: Mapping[str, LayerSettings] | Iterable[LayerSettings], *,
                 notes: Iterable[str] = ()) -> None:
        items = (list(layers.items()) if isinstance(layers, Mapping)
                 else [(getattr(s, "name", None), s) for s in layers])
        found: dict[str, LayerSettings] = {}
        for key, s in items:
            if not isinstance(s, LayerSettings):
                raise ConfigError(f"layer {key!r}: expected LayerSettings, got "
                                  f"{type(s).__name__}", layer=key, value=s)
            if key != s.name:
                raise ConfigError(f"layer {key!r}: holds the settings of {s.name!r}",
                                  layer=key, value=s.name)
            if key in found:
                raise ConfigError(f"layer {key!r}: given twice", layer=key)
            found[key] = s
        missing = [n for n in LAYER_NAMES if n not in found]
        if missing:
            raise ConfigError(f"missing layers: {listed(missing)}; an OverlapConfig holds all "
                              f"of {listed(LAYER_NAMES)} (use OverlapConfig.load for defaults)")
        self._layers = {n: found[n] for n in LAYER_NAMES}
        self._notes = tuple(notes)
        _check_atomic_pairs(self._layers)
        _check_unused_wgrads(self._layers)

    # -- construction -------------------------------------------------------------------------
    @classmethod
    def load(cls, source: None | str | os.PathLike[str] | Mapping[str, Any] = None, *,
             rs_dgrad: bool = False) -> "OverlapConfig":
        """TE defaults (None), a ub_cfgs YAML file (path), YAML text (a str with a newline),
        or a ub_cfgs mapping. Given keys override the defaults of the method the layer ends
        up with. rs_dgrad=True reads it as TE does with Megatron's tp_comm_overlap_rs_dgrad:
        qkv_dgrad/fc1_dgrad become GEMM+reduce-scatter overlaps; one left on bulk (or not
        named) runs as pipeline, which is what TE's module does with a bulk communicator."""
        layers, notes = parse(source, bool(rs_dgrad))
        return cls(layers, notes=notes)

    def replace(self, name: str, **changes: Any) -> "OverlapConfig":
        """A new config with layer `name` changed; the other keys of that layer keep their
        current values (load a dict to get per-method defaults instead)."""
        if name not in self._layers:
            raise unknown_layer(name, LAYER_NAMES)
        for key in changes:
            if key not in KEYS:
                raise unknown_key(name, key, KEYS)
        dgrad = _dgrad_of_unused(self._layers, name)
        if dgrad and changes:
            key = next(iter(changes))
            raise ConfigError(
                f"layer {name!r}, key {key!r}: cannot be configured while {dgrad!r} uses "
                f"{self._layers[dgrad].method!r} (a reduce-scatter dgrad leaves {name} unused; "
                f"TE rejects settings for it); allowed: set {dgrad} method 'bulk' first",
                layer=name, key=key, value=changes[key])
        layers = dict(self._layers)
        layers[name] = dataclasses.replace(self._layers[name], **changes)
        return OverlapConfig(layers, notes=self._notes)

    # -- Mapping ------------------------------------------------------------------------------
    def __getitem__(self, name: str) -> LayerSettings:
        try:
            return self._layers[name]
        except (KeyError, TypeError):
            raise unknown_layer(name, LAYER_NAMES) from None

    def __contains__(self, name: object) -> bool:
        return name in self._layers

    def __iter__(self) -> Iterator[str]:
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, OverlapConfig):
            return NotImplemented
        return self._layers == other._layers

    def __hash__(self) -> int:
        return hash(tuple(self._layers.values()))

    def __repr__(self) -> str:
        changed = [n for n, s in self._layers.items() if s != LayerSettings.default(n)]
        return f"OverlapConfig({len(changed)} layers differ from TE defaults: {changed})"

    # -- what the settings mean ---------------------------------------------------------------
    @property
    def rs_dgrad_layers(self) -> tuple[str, ...]:
        """The dgrads that reduce-scatter (TE's rs-dgrad path): their method is not bulk."""
        return tuple(d for d in RS_DGRAD_LAYERS if self._layers[d].method != "bulk")

    @property
    def unused_layers(self) -> tuple[str, ...]:
        """Layers no GEMM uses: the wgrad partner of each rs-dgrad dgrad."""
        return tuple(wgrad_of(d) for d in self.rs_dgrad_layers)

    @property
    def notes(self) -> tuple[str, ...]:
        """How the source was read (anything accepted but not stored as given) and what the
        settings imply across layers."""
        implied = tuple(
            f"{d}: {self._layers[d].method} makes it a GEMM+reduce-scatter (TE's rs-dgrad path; "
            f"Megatron needs tp_comm_overlap_rs_dgrad) and leaves {wgrad_of(d)} unused"
            for d in self.rs_dgrad_layers)
        return self._notes + implied

    def effects(self, name: str, backend: str) -> dict[str, str]:
        """LayerSettings.effects plus what other layers imply (an unused wgrad)."""
        out = self[name].effects(backend)
        dgrad = _dgrad_of_unused(self._layers, name)
        if dgrad:
            why = f"no effect: unused while {dgrad} reduce-scatters (TE turns the bulk wgrad off)"
            out = {k: why for k in out}
        return out

    # -- output -------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain TE ub_cfgs: every key explicit (`aggregate` "auto" aside:
        LayerSettings.to_dict); unused wgrads left out (TE refuses them)."""
        unused = self.unused_layers
        return {n: s.to_dict() for n, s in self._layers.items() if n not in unused}

    def to_yaml(self, path: str | os.PathLike[str] | None = None) -> str:
        """to_dict() as YAML text; also written to `path` when given."""
        text = _YAML_HEADER + yaml.safe_dump(self.to_dict(), sort_keys=False,
                                             default_flow_style=False)
        if path is not None:
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        return text

    def table(self, backend: str = "torch_p2p", tp_size: int | None = None) -> str:
        """Console table, one row per layer, with the keys that do nothing on `backend`."""
        from .table import render

        return render(self, backend, tp_size)


def _dgrad_of_unused(layers: Mapping[str, LayerSettings], name: str) -> str | None:
    for d in RS_DGRAD_LAYERS:
        if name == wgrad_of(d) and layers[d].method != "bulk":
            return d
    return None


def _check_atomic_pairs(layers: Mapping[str, LayerSettings]) -> None:
    """TE: an atomic ring-exchange all-gather shuffles GEMM chunk outputs that only an
    atomic ring-exchange reduce-scatter un-shuffles, so the two halves of a TP block
    (qkv_fprop/proj_fprop, fc1_fprop/fc2_fprop) use it together or not at all."""
    for ag, rs in AG_RS_PAIRS.items():
        a, r = layers[ag], layers[rs]
        a_on = a.atomic_gemm and a.method == "ring_exchange"
        r_on = r.atomic_gemm and r.method == "ring_exchange"
        if a_on != r_on:
            raise ConfigError(
                f"layer {rs!r}, key 'atomic_gemm': got {r.atomic_gemm!r} with method "
                f"{r.method!r} while {ag!r} has atomic_gemm={a.atomic_gemm!r} with method "
                f"{a.method!r}; allowed: {ag} and {rs} both use atomic_gemm with ring_exchange, "
                "or neither does (TE: the atomic ring-exchange all-gather shuffles GEMM chunk "
                "outputs that only its reduce-scatter partner un-shuffles)",
                layer=rs, key="atomic_gemm", value=r.atomic_gemm)


def _check_unused_wgrads(layers: Mapping[str, LayerSettings]) -> None:
    """An unused wgrad keeps TE's defaults: TE refuses settings for it, and to_dict() leaves
    it out, so anything else could not round-trip."""
    for d in RS_DGRAD_LAYERS:
        if layers[d].method == "bulk":
            continue
        w = wgrad_of(d)
        default = LayerSettings.default(w)
        if layers[w] != default:
            key = next(k for k in KEYS if getattr(layers[w], k) != getattr(default, k))
            raise ConfigError(
                f"layer {w!r}, key {key!r}: got {getattr(layers[w], key)!r}; allowed: TE's "
                f"default {getattr(default, key)!r} while {d!r} uses {layers[d].method!r} "
                f"(a reduce-scatter dgrad leaves {w} unused; TE rejects settings for it)",
                layer=w, key=key, value=getattr(layers[w], key))
