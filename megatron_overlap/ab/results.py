"""Where benchmark results go and how they are written: strict JSON (a NaN, e.g.
a compute-only arm's loss, becomes null), under a name that says where it ran."""

from __future__ import annotations

import json
import math
import os
import sys

from .launch import Layout


def stem(out_dir: str, benchmark: str, layout: Layout, tag: str | None = None) -> str:
    """<out_dir>/<benchmark>_<tag>; tag defaults to cpu | shared_gpu_tpN | gpu_tpN,
    with _nodesAxB when the ranks see several nodes (LOCAL_WORLD_SIZE below N:
    emulated with --gpus-per-node, or real ones under torchrun)."""
    if tag is None:
        tag = {"cpu": "cpu", "shared_gpu": f"shared_gpu_tp{layout.world}",
               "gpus": f"gpu_tp{layout.world}"}[layout.mode]
        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", layout.world))
        if per_node < layout.world:
            tag += f"_nodes{layout.world // per_node}x{per_node}"
    return os.path.join(out_dir, f"{benchmark}_{tag}")


def _finite(x):
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def write_json(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(_finite(doc), f, indent=1, allow_nan=False)


def read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def passed(out_dir: str, benchmark: str, layout: Layout, tag: str | None, key: str, failure: str) -> int:
    """After a run: the exit code for rank 0 (0, or 2 when the JSON's `key` check failed,
    saying so); other ranks under torchrun return 0, rank 0 reports."""
    if "RANK" in os.environ and int(os.environ["RANK"]) != 0:
        return 0
    ok = read_json(stem(out_dir, benchmark, layout, tag) + ".json")[key]
    if not ok:
        print(f"{failure} (see the table / JSON)", file=sys.stderr)
    return 0 if ok else 2

