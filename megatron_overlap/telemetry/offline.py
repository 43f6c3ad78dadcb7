"""Read an offline wandb run back: config, per-step history, logged tables.

wandb 0.31 has no Python reader for its `.wandb` transaction log (the old
`wandb.sdk.internal.datastore` is gone; the Go core writes the file) and an
offline run writes no config.yaml, summary or history files. The log is the
LevelDB log format with a 7-byte W&B header, its records wandb's own protobuf
`Record`s, so we read it here with wandb's proto classes. Tables live beside
it as files/media/table/*.table.json, named by the history entry."""

from __future__ import annotations

import glob
import json
import os
import struct
import zlib
from typing import Any, Iterator

_HEADER = struct.Struct("<4sHB")  # ident, magic, version
_IDENT, _MAGIC = b":W&B", 0xBEE1
_REC = struct.Struct("<IHB")  # crc32 (of type byte + data), length, type
_BLOCK = 32768
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def iter_records(path: str) -> Iterator[Any]:
    """wandb `Record` protos from a .wandb file, in order. Stops quietly at a torn
    or corrupt tail (a run still writing, or killed), as LevelDB readers do."""
    from ..extras import require

    pb = require("wandb.proto.wandb_internal_pb2", "reading a wandb run back")

    with open(path, "rb") as f:
        data = f.read()
    if len(data) < _HEADER.size:
        return
    ident, magic, _ = _HEADER.unpack_from(data)
    if ident != _IDENT or magic != _MAGIC:
        raise ValueError(f"{path}: not a wandb run log (header {data[:_HEADER.size]!r})")
    pos, parts = _HEADER.size, []
    while True:
        left = _BLOCK - pos % _BLOCK
        if left < _REC.size:  # block trailer padding
            pos += left
            continue
        if pos + _REC.size > len(data):
            return
        crc, length, kind = _REC.unpack_from(data, pos)
        chunk = data[pos + _REC.size:pos + _REC.size + length]
        if len(chunk) < length or kind not in (_FULL, _FIRST, _MIDDLE, _LAST) or \
                zlib.crc32(chunk, zlib.crc32(bytes([kind]))) != crc:
            return
        pos += _REC.size + length
        parts = [chunk] if kind in (_FULL, _FIRST) else parts + [chunk]
        if kind in (_FULL, _LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            yield record


def _value(item: Any) -> Any:
    """An item's value: the typed field when set (keeps int vs float), else JSON."""
    typed = item.WhichOneof("value") if "value" in item.DESCRIPTOR.oneofs_by_name else None
    if typed == "none":
        return None
    if typed == "json":
        return json.loads(item.json)
    if typed is not None:
        return getattr(item, typed)
    return json.loads(item.value_json) if item.value_json else None


def _put(target: dict, item: Any) -> None:
    """Set `key`, or the nested path `nested_key` (wandb 0.31 writes keys that way)."""
    path = list(item.nested_key) or [item.key]
    for k in path[:-1]:
        target = target.setdefault(k, {})
    target[path[-1]] = _value(item)


def _drop(target: dict, item: Any) -> None:
    path = list(item.nested_key) or [item.key]
    for k in path[:-1]:
        target = target.get(k, {})
    target.pop(path[-1], None)


def find_run(run_dir: str) -> str:
    """The run folder for: the folder itself, its files/ (run.dir), its .wandb file,
    or the `dir` given to wandb.init / its wandb/ folder (then the latest run)."""
    path = os.path.abspath(run_dir)
    if path.endswith(".wandb") and os.path.isfile(path):
        return os.path.dirname(path)
    for cand in (path, os.path.dirname(path)):
        if glob.glob(os.path.join(cand, "run-*.wandb")) or (os.path.isdir(os.path.join(cand, "files")) \
                and os.path.basename(cand).startswith(("offline-run-", "run-"))):
            return cand
    for base in (path, os.path.join(path, "wandb")):
        latest = os.path.join(base, "latest-run")
        if os.path.exists(latest):
            return os.path.realpath(latest)
        runs = sorted(glob.glob(os.path.join(base, "offline-run-*")) + glob.glob(os.path.join(base, "run-*")))
        runs = [r for r in runs if os.path.isdir(r)]
        if runs:
            return runs[-1]
    raise FileNotFoundError(f"no wandb run under {run_dir}")


def _read_table(files_dir: str, ref: Any) -> list[dict[str, Any]] | None:
    if not (isinstance(ref, dict) and ref.get("_type") in ("table-file", "table") and ref.get("path")):
        return None
    with open(os.path.join(files_dir, ref["path"]), encoding="utf-8") as f:
        t = json.load(f)
    return [dict(zip(t["columns"], row)) for row in t["data"]]


def _from_log(path: str) -> tuple[dict, list[dict], dict]:
    config: dict[str, Any] = {}
    history: list[dict[str, Any]] = []
    summary: dict[str, Any] = {}
    for record in iter_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            for item in record.run.config.update:
                _put(config, item)
        elif kind == "config":
            for item in record.config.update:
                _put(config, item)
            for item in record.config.remove:
                _drop(config, item)
        elif kind == "history":
            row: dict[str, Any] = {}
            for item in record.history.item:
                _put(row, item)
            history.append(row)
        elif kind == "summary":
            for item in record.summary.update:
                _put(summary, item)
            for item in record.summary.remove:
                _drop(summary, item)
    return config, history, summary


def _from_files(files_dir: str) -> tuple[dict, list[dict], dict]:
    """What a synced or older run leaves in files/: config.yaml ({key: {value}}),
    wandb-summary.json, wandb-history.jsonl (gone in recent wandb)."""
    import yaml

    config: dict[str, Any] = {}
    cfg = os.path.join(files_dir, "config.yaml")
    if os.path.exists(cfg):
        with open(cfg, encoding="utf-8") as f:
            raw = yaml.safe_load(f) or {}
        config = {k: v.get("value") if isinstance(v, dict) and "value" in v else v for k, v in raw.items()}
    history: list[dict[str, Any]] = []
    hist = os.path.join(files_dir, "wandb-history.jsonl")
    if os.path.exists(hist):
        with open(hist, encoding="utf-8") as f:
            history = [json.loads(line) for line in f if line.strip()]
    summary: dict[str, Any] = {}
    summ = os.path.join(files_dir, "wandb-summary.json")
    if os.path.exists(summ):
        with open(summ, encoding="utf-8") as f:
            summary = json.load(f)
    return config, history, summary


def wait_for_exit(run_dir: str, timeout: float = 60.0) -> None:
    """Block until the offline run under `run_dir` has its exit record: on a loaded
    machine wandb's writer process may still be flushing the log when `finish()`
    returns (seen: a header-only file). Call it before reading a run just finished."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            logs = glob.glob(os.path.join(find_run(run_dir), "run-*.wandb"))
        except FileNotFoundError:
            logs = []
        if any(r.WhichOneof("record_type") == "exit" for log in logs for r in iter_records(log)):
            return
        time.sleep(0.2)
    raise TimeoutError(f"megatron_overlap.telemetry: no exit record in the wandb run under "
                       f"{run_dir} after {timeout:g}s; did the run call finish()?")


def read_offline_run(run_dir: str) -> dict[str, Any]:
    """{"config", "history", "tables", "summary"} of a wandb run on disk.

    history: one dict per logged step (with wandb's _step, _runtime, _timestamp),
    logged tables taken out (steps that held only tables are dropped); tables:
    {key: [row dicts]} as last logged. run_dir: see find_run."""
    run = find_run(run_dir)
    files_dir = os.path.join(run, "files")
    logs = sorted(glob.glob(os.path.join(run, "run-*.wandb")))
    config, history, summary = _from_log(logs[-1]) if logs else _from_files(files_dir)
    tables: dict[str, list[dict[str, Any]]] = {}
    steps = []
    for row in history:
        for key, value in list(row.items()):
            rows = _read_table(files_dir, value)
            if rows is not None:
                tables[key] = rows
                del row[key]
        if any(not k.startswith("_") for k in row):
            steps.append(row)
    return {"config": config, "history": steps, "tables": tables, "summary": summary}
