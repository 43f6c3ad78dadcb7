"""Peers that fail: run ranks that may raise or exit, and inject the failure at a
chosen point of a layer's forward or backward (tests/test_robust_faults.py).

`run_ranks` never hangs: ranks still running at its deadline are killed, and each
rank's outcome (its return value, its traceback, its exit code, or 'killed') is
reported, so a test can assert on the survivors."""

from __future__ import annotations

import os
import queue as queue_mod
import time
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from helpers.dist import _entry, _free_port

KILLED = "killed at the harness deadline"
# Ranks fork from a server that imported these once: a case starts in about a second,
# not the several seconds a fresh interpreter spends importing torch and Megatron.
PRELOAD = ["torch", "torch.distributed", "megatron.core", "megatron.core.tensor_parallel",
           "megatron.core.parallel_state", "megatron_overlap", "megatron_overlap.layers",
           "helpers.dist", "helpers.faults", "helpers.robust", "helpers.megatron_cpu",
           "helpers.disagree"]
_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


def run_ranks(fn: Callable, world: int, *args: Any, env: dict | None = None,
              timeout: float = 60) -> list[tuple[str, Any]]:
    """fn(rank, world, *args) on `world` processes. Per rank: ("ok", value),
    ("raised", traceback), ("exited", code) or ("killed", KILLED)."""
    ctx = _context()
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, env or {}, fn, args, q, timeout))
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(out) < world and time.monotonic() < deadline:
            try:
                rank, ok, value = q.get(timeout=0.5)
                out[rank] = ("ok" if ok else "raised", value)
            except queue_mod.Empty:
                for r, p in enumerate(procs):
                    if r not in out and p.exitcode is not None:
                        time.sleep(0.5)  # its report may still be in the pipe
                        while not q.empty():
                            rank, ok, value = q.get()
                            out[rank] = ("ok" if ok else "raised", value)
                        if r not in out:
                            out[r] = ("exited", p.exitcode)
    finally:
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                out.setdefault(r, ("killed", KILLED))
            p.join(timeout=10)
    return [out[r] for r in range(world)]


class Injected(RuntimeError):
    """The failure a test makes a peer raise."""


def fail(mode: str, where: str) -> None:
    if mode == "exit":
        os._exit(17)
    raise Injected(f"injected failure {where}")


def count_transfers(tp) -> list[str]:
    """Record the op of every transfer this transport starts (in place, on the instance)."""
    log: list[str] = []
    for name in ("exchange", "all_gather", "reduce_scatter", "all_reduce"):
        inner = getattr(tp, name)

        def wrapped(*a, _inner=inner, **k):
            log.append(k.get("op", "?"))
            hook = getattr(tp, "_fault_hook", None)
            if hook is not None:
                hook(len(log))
            return _inner(*a, **k)
        setattr(tp, name, wrapped)
    return log


def arm(tp, log: list[str], after: int, mode: str, where: str) -> None:
    """Fail when the transport is about to start transfer number `after` + 1 from now."""
    start = len(log)

    def hook(n: int) -> None:
        if n - start > after:
            tp._fault_hook = None
            fail(mode, where)
    tp._fault_hook = hook


def step(layer, x: torch.Tensor, seed: int = 3) -> None:
    y, _ = layer(x.detach().requires_grad_())
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)))


def one_case(rank: int, world: int, kind: str, sp: bool, variant: str, point: str, mode: str,
             victim: int = 1) -> dict:
    """The victim fails at `point` (first_forward | forward | backward | between) of a
    forward + backward through one layer; the others run on. What every rank saw."""
    import torch.distributed as dist

    from helpers.robust import global_input, pair

    ours = pair(kind, sp, variant, world)[1]
    dist.barrier()  # ranks start each phase together: the 2 s timeout measures the fault only
    x = global_input(ours, rank, world, 4, 2, seed=1)
    dy = None
    n = {"forward": 0, "backward": 0}
    if point not in ("first_forward", "topology"):
        step(ours, x)  # warm-up: topology exchanged, transport built
        log = count_transfers(ours.transport)
        y, _ = ours(x.detach().requires_grad_())
        n["forward"] = len(log)
        y.backward(torch.ones_like(y))
        n["backward"] = len(log) - n["forward"]
    out = {"rank": rank, "transfers": n}
    dist.barrier()
    t0 = time.monotonic()
    try:
        xi = x.detach().requires_grad_()
        if rank == victim and point in ("first_forward", "topology"):
            fail(mode, "before the first forward")
        if point == "topology":  # the exchange the first forward makes to pick the transport
            from megatron_overlap import comm

            comm.topology(ours.tp_group)
        if rank == victim and point == "forward":
            if n["forward"] == 0:
                fail(mode, "at the start of the forward")
            arm(ours.transport, log, min(1, n["forward"] - 1), mode, "inside the forward")
        y, _ = ours(xi)
        dy = torch.ones_like(y)
        if rank == victim and point == "between":
            fail(mode, "between the forward and the backward")
        if rank == victim and point == "backward":
            if n["backward"] == 0:
                fail(mode, "at the start of the backward")
            arm(ours.transport, log, min(1, n["backward"] - 1), mode, "inside the backward")
        y.backward(dy)
        out["result"] = "no error"
    except Exception as e:  # noqa: BLE001 - the test reads type and message
        out["result"] = f"{type(e).__name__}: {e}"
    out["elapsed"] = time.monotonic() - t0
    return out


def leave_together(rank: int, world: int) -> None:
    """End a case on every rank together: each rank stays (a failed peer stays silent)
    until all are done; rank 0 hosts the store, so it leaves last, once every other
    rank's last store call is answered."""
    import datetime

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    wait = datetime.timedelta(seconds=60)
    store.set(f"case_done_{rank}", "1")
    store.wait([f"case_done_{r}" for r in range(world)], wait)
    if rank == 0:
        store.wait([f"case_left_{r}" for r in range(1, world)], wait)
    else:
        store.set(f"case_left_{rank}", "1")


def raise_case(rank: int, world: int, case: tuple) -> dict:
    """The victim raises and stays alive, holding its connections, until rank 0 has
    its diagnosis: rank 0 can only learn of the failure from its own timeout."""
    from helpers.megatron_cpu import init

    init(world)
    try:
        return one_case(rank, world, *case, mode="raise")
    finally:
        leave_together(rank, world)


def exit_case(rank: int, world: int, case: tuple, victim: int) -> dict:
    """One case where the victim's process ends (os._exit) at the chosen point."""
    from helpers.megatron_cpu import init

    init(world)
    return one_case(rank, world, *case, mode="exit", victim=victim)
