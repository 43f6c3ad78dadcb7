"""Run a function on N gloo ranks in fresh processes and collect what each returns."""

from __future__ import annotations

import faulthandler
import os
import queue as queue_mod
import time
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


_next_port = [0]


def _free_port() -> int:
    """A port for a test's rendezvous store. Not one the OS hands out on its own (port 0):
    those come from the ephemeral range, which every gloo connection's client socket draws
    from too, so under pytest-xdist another test's socket could take it before the store
    binds (seen: EADDRINUSE). Each xdist worker probes its own slice of 20000-31999, below
    Linux's ephemeral range, and never the same port twice in a row."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    base, span = 20000 + (index % 12) * 1000, 1000
    if not _next_port[0]:
        _next_port[0] = os.getpid() % span
    for _ in range(span):
        _next_port[0] = (_next_port[0] + 1) % span
        port = base + _next_port[0]
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {base}-{base + span - 1}")


def _entry(rank: int, world: int, port: int, env: dict, fn: Callable, args: tuple, queue,
           timeout: float, received) -> None:
    # A rank still running shortly before the parent gives up prints every thread's
    # stack (even one holding the GIL): a hang comes with where it hangs.
    faulthandler.dump_traceback_later(max(timeout - 20, timeout * 0.6), exit=False)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), **env})
    try:
        queue.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # report, never hang the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        faulthandler.cancel_dump_traceback_later()
    # CPU tensors in a result travel as shared-memory file descriptors that the parent
    # opens from this process when it unpickles them: stay until it has (seen:
    # FileNotFoundError in the parent when a rank had already exited), or until the
    # parent is gone. Results are CPU data (a CUDA tensor would need its sender alive
    # for as long as the parent holds it).
    parent = os.getppid()
    deadline = time.monotonic() + timeout
    while not received.wait(1.0) and os.getppid() == parent and time.monotonic() < deadline:
        pass


def run(fn: Callable, world: int, *args: Any, env: dict | None = None, timeout: float = 240) -> list:
    """fn(rank, world, *args) on `world` processes; returns the per-rank results.
    A rank that raises fails the call with its traceback; one that never reports
    fails it after `timeout` seconds with the ranks that did not answer."""
    ctx = mp.get_context("spawn")
    queue, received = ctx.Queue(), ctx.Event()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, env or {}, fn, args, queue, timeout,
                                              received), daemon=False)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world:
            try:
                rank, ok, value = queue.get(timeout=1.0)
            except queue_mod.Empty:
                missing = sorted(set(range(world)) - set(results))
                dead = [r for r in missing if procs[r].exitcode is not None]
                if dead:
                    raise RuntimeError(f"ranks {dead} exited (codes "
                                       f"{[procs[r].exitcode for r in dead]}) without reporting")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {missing} did not report within {timeout}s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results[rank] = value
    finally:
        received.set()  # every result is unpickled (or the call failed): the ranks may go
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
