"""ConfigError and its message builders: every rejected input says which layer,
which key, what value, and what would have been accepted, so a typo in a
200-line YAML is found from the message alone."""

from __future__ import annotations

import difflib
from typing import Any, Iterable

_UNSET = object()


class ConfigError(ValueError):
    """A TP-overlap config input that cannot be accepted.

    ``layer``, ``key`` and ``value`` carry the offending spot for programmatic use
    (``None`` / unset where not applicable)."""

    def __init__(self, message: str, *, layer: str | None = None, key: str | None = None,
                 value: Any = _UNSET) -> None:
        super().__init__(message)
        self.layer, self.key = layer, key
        self.value = None if value is _UNSET else value

    def __str__(self) -> str:  # plain text even when mixed with KeyError
        return str(self.args[0]) if self.args else ""


class UnknownLayerError(ConfigError, KeyError):
    """Unknown layer name; also a KeyError so OverlapConfig honours the Mapping contract."""


def did_you_mean(word: object, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest choice, or '' when nothing is close."""
    if not isinstance(word, str):
        return ""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def listed(choices: Iterable[str]) -> str:
    return ", ".join(choices)


def bad_value(layer: str, key: str, value: Any, allowed: str, hint: str = "") -> ConfigError:
    return ConfigError(f"layer {layer!r}, key {key!r}: got {value!r}; allowed: {allowed}{hint}",
                       layer=layer, key=key, value=value)


def unknown_layer(name: object, allowed: Iterable[str]) -> UnknownLayerError:
    allowed = list(allowed)
    return UnknownLayerError(
        f"unknown layer {name!r}{did_you_mean(name, allowed)}; allowed layers: {listed(allowed)}",
        layer=name if isinstance(name, str) else None, value=name)


def unknown_key(layer: str, key: object, allowed: Iterable[str]) -> ConfigError:
    allowed = list(allowed)
    return ConfigError(
        f"layer {layer!r}: unknown key {key!r}{did_you_mean(key, allowed)}; "
        f"allowed keys: {listed(allowed)}",
        layer=layer, key=key if isinstance(key, str) else None, value=key)
