"""The tuner's measurement cache: one JSON line per measurement, keyed by
(shape, settings, hardware, KEY_VERSION), appended and flushed as each one finishes, so a
search that is interrupted resumes without measuring anything twice."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any


# Bumped whenever what a cached result means changes, so an older file's entries are never
# served: part of every key (and written beside it; entries of another version are skipped on
# load). 2: one-GPU (compute) results time each candidate's own pass, aggregate and
# gemm_streams applied (version 1's were predicted from the one-stream timing of whichever
# candidate of that shape and chunk count came first); measured hardware names the default
# gemm_streams. 3: one-GPU (compute) results take each pass's monolithic GEMM (bulk and
# external compute sides, baselines, chunked ratios) timed in that pass's operand layout
# (fprop NT, dgrad NN, wgrad TN); version 2's timed every pass's in NT, and shared one timing
# between passes of the same (m, k, n). 5: `aggregate` runs Transformer Engine's pairs
# (one GEMM of two adjacent blocks a step after the partner's) where it ran both ring
# directions (two GEMMs of one block a step). 6: the ring reduce-scatter sends each
# partial to its owner and sums them in one kernel, where it forwarded running sums. 7: the
# hierarchical reduce-scatter does the same inside each node and sums the node partials in
# one kernel, where it forwarded running sums and added the node partials one by one.
KEY_VERSION = 7


def cache_key(job: dict[str, Any], hardware: dict[str, Any]) -> str:
    """Stable hash of what was measured and where, and of KEY_VERSION."""
    blob = json.dumps({"version": KEY_VERSION, "job": job, "hardware": hardware}, sort_keys=True,
                      default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


class Cache:
    """key -> result dict, backed by a JSONL file (None: in memory only). A torn last
    line (a run killed mid-write) is ignored."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = os.fspath(path) if path is not None else None
        self._data: dict[str, dict[str, Any]] = {}
        self._torn = False  # the file ends mid-line: start the next entry on a new one
        if self.path and os.path.exists(self.path):
            with open(self.path, "rb") as f:
                text = f.read()
            self._torn = bool(text) and not text.endswith(b"\n")
            with open(self.path, encoding="utf-8") as f:
                for line in f:
                    try:
                        entry = json.loads(line)
                        if entry.get("version") == KEY_VERSION:
                            self._data[entry["key"]] = entry["result"]
                    except (json.JSONDecodeError, KeyError, TypeError):
                        continue

    def __contains__(self, key: str) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    def get(self, key: str) -> dict[str, Any] | None:
        return self._data.get(key)

    def put(self, key: str, job: dict[str, Any], hardware: dict[str, Any],
            result: dict[str, Any]) -> None:
        self._data[key] = result
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                if self._torn:
                    f.write("\n")
                    self._torn = False
                f.write(json.dumps({"key": key, "version": KEY_VERSION, "job": job,
                                    "hardware": hardware,
                                    "result": result}, default=str) + "\n")
                f.flush()
