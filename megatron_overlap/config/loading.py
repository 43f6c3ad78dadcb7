"""Reading a TE ub_cfgs source (None, YAML path, YAML text or mapping) into one
LayerSettings per layer, with TE's defaulting and TE's rs-dgrad switch.

Everything that is accepted but not stored as given (null layers, the derived
is_reduce_scatter key, ignored wgrad settings, defaults that differ from TE's)
becomes a note, so nothing disappears without a word.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import yaml

from .errors import ConfigError, bad_value, unknown_key, unknown_layer
from .names import (
    DEFAULT_METHODS, DERIVED_KEYS, KEYS, LAYER_NAMES, RS_DGRAD_LAYERS, is_reduce_scatter,
    te_defaults, wgrad_of,
)
from .settings import LayerSettings, coerce

_PER_METHOD_KEYS = ("num_sm", "cga_size", "set_sm_margin", "num_splits")


def read_source(source: Any) -> Mapping[str, Any]:
    """The raw ub_cfgs mapping: {} for None; a str is a file path, or YAML text when it
    holds a newline (what to_yaml() returns); a PathLike is always a file."""
    if source is None:
        return {}
    if isinstance(source, Mapping):
        return source
    if isinstance(source, os.PathLike) or (isinstance(source, str) and os.path.exists(source)):
        path = os.fspath(source)
        try:
            with open(path, encoding="utf-8") as f:
                text, origin = f.read(), path
        except OSError as e:
            raise ConfigError(f"cannot read overlap config {path!r}: {e.strerror}") from e
    elif isinstance(source, str) and ("\n" in source or source.lstrip().startswith("{")):
        text, origin = source, "YAML text"
    elif isinstance(source, str):
        raise ConfigError(f"overlap config file {source!r} does not exist (a str is read as a "
                          "path, or as YAML text when it contains a newline)", value=source)
    else:
        raise ConfigError(f"overlap config source must be None, a YAML path, YAML text or a "
                          f"mapping; got {type(source).__name__}", value=source)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{origin}: not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{origin}: expected a mapping of layer names to settings, "
                          f"got {type(data).__name__}", value=data)
    return data


def parse(source: Any, rs_dgrad: bool) -> tuple[dict[str, LayerSettings], list[str]]:
    """One LayerSettings per layer from a ub_cfgs source, and the notes on how it was read.
    An error in a file names the file first."""
    try:
        return _parse(source, rs_dgrad)
    except ConfigError as e:
        path = _path_of(source)
        if path is None or path in str(e):
            raise
        raise type(e)(f"{path}: {e}", layer=e.layer, key=e.key, value=e.value) from None


def _path_of(source: Any) -> str | None:
    if isinstance(source, os.PathLike) or (isinstance(source, str) and os.path.exists(source)):
        return os.fspath(source)
    return None


def _parse(source: Any, rs_dgrad: bool) -> tuple[dict[str, LayerSettings], list[str]]:
    raw, notes = read_source(source), []
    given: dict[str, dict[str, Any]] = {}
    for name, entry in raw.items():
        if name not in LAYER_NAMES:
            raise unknown_layer(name, LAYER_NAMES)
        if entry is None:  # NeMo's recipes set unused layers to None and drop them
            notes.append(f"{name}: null entry read as not given (TE defaults)")
            continue
        if not isinstance(entry, Mapping):
            raise ConfigError(f"layer {name!r}: expected a mapping of keys, got {entry!r}",
                              layer=name, value=entry)
        for key in entry:
            if key not in KEYS and key not in DERIVED_KEYS:
                raise unknown_key(name, key, KEYS + DERIVED_KEYS)
        if "method" in entry:
            coerce(name, "method", entry["method"])
        given[name] = dict(entry)

    methods = {name: given.get(name, {}).get("method", DEFAULT_METHODS[name])
               for name in LAYER_NAMES}
    for dgrad in RS_DGRAD_LAYERS:
        wgrad, named = wgrad_of(dgrad), given.get(dgrad, {}).get("method")
        if named is not None and named != "bulk" and wgrad in given:
            key = next(iter(given[wgrad]), None)
            spot = f"layer {wgrad!r}" + (f", key {key!r}" if key else "")
            raise ConfigError(
                f"{spot}: cannot be configured while {dgrad!r} uses {named!r} "
                f"(a reduce-scatter dgrad leaves {wgrad} unused; TE's initialize_ub rejects "
                f"this too); allowed: drop the {wgrad} entry or give {dgrad} method 'bulk'",
                layer=wgrad, key=key, value=given[wgrad].get(key) if key else None)
        if rs_dgrad and named in (None, "bulk"):
            # Megatron's tp_comm_overlap_rs_dgrad with a bulk dgrad communicator: TE's module
            # calls the GEMM with comm_type RS and bulk_overlap=False, i.e. the pipelined split.
            methods[dgrad] = "pipeline"
            if named == "bulk":
                notes.append(f"{dgrad}: method bulk read as pipeline under rs_dgrad (TE runs the "
                             "dgrad reduce-scatter through this communicator's pipelined split)")
            if wgrad in given:
                notes.append(f"{wgrad}: settings ignored: unused while {dgrad} reduce-scatters "
                             "(TE turns the bulk wgrad overlap off)")
                del given[wgrad]

    layers = {}
    for name in LAYER_NAMES:
        entry, method = given.get(name, {}), methods[name]
        values = te_defaults(name, method)
        for key, value in entry.items():
            if key == "is_reduce_scatter":
                _check_derived(name, method, value, notes)
            else:
                values[key] = value
        values["method"] = method
        layers[name] = LayerSettings(name=name, **values)
        _note_default_drift(name, method, entry, values, notes)
    return layers, notes


def _check_derived(name: str, method: str, value: Any, notes: list[str]) -> None:
    want, got = is_reduce_scatter(name, method), coerce(name, "is_reduce_scatter", value)
    if got != want:
        kind = "a reduce-scatter" if want else "an all-gather"
        raise bad_value(name, "is_reduce_scatter", value, f"{want} ({name} with {method} is "
                        f"{kind} overlap; the layer and method fix it)")
    notes.append(f"{name}: TE key is_reduce_scatter={got} accepted (matches the layer; derived, "
                 "not stored)")


def _note_default_drift(name: str, method: str, entry: Mapping[str, Any],
                        values: Mapping[str, Any], notes: list[str]) -> None:
    """TE's get_default_config keys defaults to the layer's *default* method (except for an
    rs-dgrad dgrad); here they follow the method given. Say where the two differ."""
    te_method = DEFAULT_METHODS[name]
    if method == te_method or name in RS_DGRAD_LAYERS:
        return
    te_values = te_defaults(name, te_method)
    drift = [k for k in _PER_METHOD_KEYS if k not in entry and values[k] != te_values[k]
             and not (k == "num_splits" and method == "ring_exchange")]
    if drift:
        ours = ", ".join(f"{k}={values[k]}" for k in drift)
        theirs = ", ".join(f"{k}={te_values[k]}" for k in drift)
        notes.append(f"{name}: method {method} without {', '.join(drift)}: took {method}'s "
                     f"defaults ({ours}); TE's initialize_ub keeps {te_method}'s ({theirs}) - "
                     "write them out to get the same numbers from both")
