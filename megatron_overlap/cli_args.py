"""Checked CLI values: argparse `type=` readers (argparse names the flag in its error)
and the checks across flags that refuse a model or layout that cannot exist."""

from __future__ import annotations

import argparse
from typing import Callable, Mapping


class FlagError(ValueError):
    """Flags that parse one by one but describe no possible model or run."""


def _integer(lo: int) -> Callable[[str], int]:
    def read(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}")
        return value
    read.__name__ = f"integer>={lo}"
    return read


positive_int = _integer(1)


def model_spec(text: str) -> tuple[str, int]:
    """--layers MODEL=N: N transformer layers (>= 1) of model MODEL."""
    model, sep, n = text.partition("=")
    if not sep or not model:
        raise argparse.ArgumentTypeError(f"expected MODEL=N, got {text!r}")
    try:
        return model, positive_int(n)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{text!r}: N {e}") from None


def check_layout(tp: int, gpus_per_node: int) -> None:
    """A TP group larger than a node fills whole nodes."""
    if tp > gpus_per_node and tp % gpus_per_node:
        raise FlagError(f"--tp {tp} with --gpus-per-node {gpus_per_node}: a TP group that spans "
                        f"nodes must fill whole nodes (a multiple of {gpus_per_node}, or at most "
                        f"{gpus_per_node})")


def check_model(dims: Mapping[str, int], tp: int, label: Callable[[str], str]) -> None:
    """Refuse transformer dimensions Megatron would refuse at TP size `tp`. `dims`:
    hidden, ffn_hidden, heads, query_groups, seq_length (ModelDims' fields);
    `label(field)` says where a value came from (its flag, or the preset)."""
    h, f, a, g, s = (dims[k] for k in ("hidden", "ffn_hidden", "heads", "query_groups",
                                       "seq_length"))
    for key in ("hidden", "ffn_hidden", "heads", "query_groups", "seq_length", "micro_batch"):
        if key in dims and dims[key] < 1:
            raise FlagError(f"{label(key)} is {dims[key]}: must be >= 1")
    rules = [
        (h % a == 0, f"{label('heads')} ({a}) must divide {label('hidden')} ({h}): the head "
                     f"size is hidden / heads"),
        (a % g == 0, f"{label('query_groups')} ({g}) must divide {label('heads')} ({a})"),
        (a % tp == 0, f"{label('heads')} ({a}) must be a multiple of --tp {tp}: each rank holds "
                      f"whole heads"),
        (g % tp == 0, f"{label('query_groups')} ({g}) must be a multiple of --tp {tp}: each rank "
                      f"holds whole query groups"),
        (f % tp == 0, f"{label('ffn_hidden')} ({f}) must be a multiple of --tp {tp}"),
        (s % tp == 0, f"{label('seq_length')} ({s}) must be a multiple of --tp {tp}: sequence "
                      f"parallelism gives each rank seq_length / TP tokens"),
    ]
    for ok, msg in rules:
        if not ok:
            raise FlagError(msg)
