"""Bounded exchanges of small Python objects among the ranks of a group.

torch's `all_gather_object` / `broadcast_object_list` wait without bound, so a peer
that died before the first forward would hang the others in the topology
exchange. These go through the c10d store instead (TCP, whatever the backend,
no device tensors): every rank posts its object under a key of its own and
waits, at most MEGATRON_OVERLAP_TIMEOUT_S, for the peers' keys. A timeout is a
`CommError` that names the ranks whose keys never came, and, inside `about(...)`,
what the exchange was for (a layer at its first forward: the exchange's own name,
'layer agreement' or 'topology', does not say which layer).
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import pickle
import weakref
from typing import Any, Iterator

import torch.distributed as dist

from .transport import CommError, default_timeout

# Exchanges so far per group and purpose: all ranks call them in the same order, so
# the n-th exchange has the same key everywhere. Keyed on the group object: a new
# process group (after a failure, or a new init) starts afresh.
_rounds: "weakref.WeakKeyDictionary[dist.ProcessGroup, dict[str, int]]" = weakref.WeakKeyDictionary()


# What the exchanges in progress are for ("layer 'fc1 (column)'"), for their messages only:
# store keys never include it, so ranks that call different layers still meet and a
# fingerprint that differs is diagnosed as such.
_about: contextvars.ContextVar[str | None] = contextvars.ContextVar("megatron_overlap_about",
                                                                     default=None)


@contextlib.contextmanager
def about(what: str) -> Iterator[None]:
    """Name, in a timeout's message, what the exchanges inside are for."""
    token = _about.set(what)
    try:
        yield
    finally:
        _about.reset(token)


def _store() -> dist.Store:
    return dist.distributed_c10d._get_default_store()


def _keys(group: dist.ProcessGroup, what: str) -> tuple[str, list[str], list[int]]:
    ranks = dist.get_process_group_ranks(group)
    per_group = _rounds.setdefault(group, {})
    n = per_group[what] = per_group.get(what, 0) + 1
    prefix = f"megatron_overlap/{group.group_name}/{what}/{n}/"
    return prefix, [prefix + str(r) for r in range(len(ranks))], ranks


def _present(store: dist.Store, key: str) -> bool | None:
    try:
        return bool(store.check([key]))
    except Exception:  # the store itself is gone (its host rank exited)
        return None


def _fail(what: str, group: dist.ProcessGroup, ranks: list[int], waited_for: list[int],
          store: dist.Store, keys: list[str], timeout: datetime.timedelta, exc: Exception):
    me, world = dist.get_rank(group), len(ranks)
    seen = {r: _present(store, keys[r]) for r in waited_for}
    missing = [r for r, ok in seen.items() if ok is False]
    if any(ok is None for ok in seen.values()):
        who = (f"the rendezvous store (hosted by global rank 0) is unreachable: that rank may "
               f"have exited ({exc})")
    else:
        who = ("group ranks " + ", ".join(f"{r} (global {ranks[r]})" for r in missing)
               + " never arrived" if missing else f"it failed: {exc}")
    prefix = f"{_about.get()}: " if _about.get() else ""
    return CommError(
        f"megatron_overlap: {prefix}rank {me}/{world} waited for '{what}' chunk 0 (from all "
        f"ranks) {timeout.total_seconds():g}s and {who}. A peer may have crashed or raised before "
        f"this point, or the ranks disagree on what they run (a rank without install(), a "
        f"different model or layer order); MEGATRON_OVERLAP_TIMEOUT_S bounds this wait.")


def all_gather_object(obj: Any, group: dist.ProcessGroup | None, what: str,
                      timeout: datetime.timedelta | None = None) -> list[Any]:
    """Every rank's `obj` (picklable, small), in group-rank order. Collective over
    `group`; `what` names the exchange in messages (and in its store keys)."""
    group = group or dist.group.WORLD
    world = dist.get_world_size(group)
    if world == 1:
        return [obj]
    timeout = timeout or default_timeout()
    store = _store()
    _, keys, ranks = _keys(group, what)
    me = dist.get_rank(group)
    try:
        store.set(keys[me], pickle.dumps(obj))
        store.wait(keys, timeout)
        return [pickle.loads(store.get(k)) for k in keys]
    except Exception as exc:  # a timeout, or the store's host gone
        raise _fail(what, group, ranks, [r for r in range(world) if r != me], store, keys,
                    timeout, exc) from exc


def broadcast_object(obj: Any, src: int, group: dist.ProcessGroup | None, what: str,
                     timeout: datetime.timedelta | None = None) -> Any:
    """Group rank `src`'s `obj` on every rank (the others pass anything)."""
    group = group or dist.group.WORLD
    if dist.get_world_size(group) == 1:
        return obj
    timeout = timeout or default_timeout()
    store = _store()
    _, keys, ranks = _keys(group, what)
    try:
        if dist.get_rank(group) == src:
            store.set(keys[src], pickle.dumps(obj))
            return obj
        store.wait([keys[src]], timeout)
        return pickle.loads(store.get(keys[src]))
    except Exception as exc:
        raise _fail(what, group, ranks, [src], store, keys, timeout, exc) from exc
