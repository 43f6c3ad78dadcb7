"""Peers that fail: run ranks that may raise or exit, and inject the failure at a
chosen point of a layer's forward or backward; the case tables and what the
survivors must see (tests/test_robust_faults.py on CPU, gloo;
tests/gpu/test_faults_symm.py on `symm`, ranks sharing one GPU).

`run_ranks` never hangs: ranks still running at its deadline are killed, and each
rank's outcome (its return value, its traceback, its exit code, or 'killed') is
reported, so a test can assert on the survivors."""

from __future__ import annotations

import os
import queue as queue_mod
import re
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
           "helpers.disagree", "helpers.gpu", "helpers.reduction"]
_ctx = None


def _context():
    global _ctx
    if _ctx is None:
        # A child forked from a server that initialised CUDA could not use it: should an
        # import above ask torch.cuda.is_available(), torch answers through NVML instead.
        os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
        _ctx = mp.get_context("forkserver")
        _ctx.set_forkserver_preload(PRELOAD)
    return _ctx


def run_ranks(fn: Callable, world: int, *args: Any, env: dict | None = None,
              timeout: float = 60) -> list[tuple[str, Any]]:
    """fn(rank, world, *args) on `world` processes. Per rank: ("ok", value),
    ("raised", traceback), ("exited", code) or ("killed", KILLED)."""
    ctx = _context()
    q, received = ctx.Queue(), ctx.Event()
    port = _free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, env or {}, fn, args, q, timeout,
                                              received))
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
        received.set()  # what came is unpickled: a rank that reported may go (helpers.dist._entry)
        grace = time.monotonic() + 2.0  # for them to go; one still stuck (a GPU wait) is ended
        for p in procs:
            p.join(timeout=max(0.0, grace - time.monotonic()))
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
    y.backward(torch.randn(y.shape, generator=torch.Generator().manual_seed(seed)).to(y.device))
    settle(layer)


def settle(layer) -> None:
    """Wait until the layer's GPU work is done, as its next call would learn of a wait
    that never ends: from the transport's check() (the watchdog's diagnosis), polled.
    GPU transports enqueue their waits and return at once, so a pass returns before a
    missing peer shows; and a CUDA call blocked behind the stuck wait (a synchronize)
    would only return when the device-side timeout traps. Nothing to do on the CPU."""
    if not layer.weight.is_cuda:
        return
    tp = layer.transport
    current = torch.cuda.current_stream()
    for stream in getattr(tp, "_streams", {}).values():  # the communication streams
        current.wait_stream(stream)
    done = torch.cuda.Event()
    done.record(current)
    while True:
        tp.check()
        try:
            if done.query():
                break
        except RuntimeError:  # the device trapped: the diagnosis first, if there is one
            tp.check()
            raise
        time.sleep(0.01)
    tp.check()


def one_case(rank: int, world: int, kind: str, sp: bool, variant: str, point: str, mode: str,
             victim: int = 1, device: str = "cpu") -> dict:
    """The victim fails at `point` (first_forward | forward | backward | between) of a
    forward + backward through one layer; the others run on. What every rank saw."""
    import torch.distributed as dist

    from helpers.robust import global_input, pair

    ours = pair(kind, sp, variant, world, device)[1]
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
        settle(ours)
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
            # "+gather": at the gather_output's gather, the forward's last transfer
            after = n["forward"] - 1 if "+gather" in variant else min(1, n["forward"] - 1)
            arm(ours.transport, log, after, mode, "inside the forward")
        y, _ = ours(xi)
        dy = torch.ones_like(y)
        if rank == victim and point == "between":
            fail(mode, "between the forward and the backward")
        if rank == victim and point == "backward":
            if n["backward"] == 0:
                fail(mode, "at the start of the backward")
            arm(ours.transport, log, min(1, n["backward"] - 1), mode, "inside the backward")
        y.backward(dy)
        settle(ours)
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


def raise_case(rank: int, world: int, case: tuple, device: str = "cpu") -> dict:
    """The victim raises and stays alive, holding its connections, until rank 0 has
    its diagnosis: rank 0 can only learn of the failure from its own timeout."""
    from helpers.robust import init

    init(world, device)
    try:
        return one_case(rank, world, *case, mode="raise", device=device)
    finally:
        leave_together(rank, world)


def exit_case(rank: int, world: int, case: tuple, victim: int, device: str = "cpu") -> dict:
    """One case where the victim's process ends (os._exit) at the chosen point."""
    from helpers.robust import init

    init(world, device)
    return one_case(rank, world, *case, mode="exit", victim=victim, device=device)


# -- the cases, and what the survivors must see ---------------------------------------------
POINTS = ("forward", "backward", "between")


def raise_cases() -> list[tuple]:
    """(kind, sp, variant, point): before the first forward (and in the topology
    exchange it makes) once; each point of a pass for each of the four layer kinds."""
    from helpers.robust import KINDS

    return [(kind, sp, variant, p) for kind, sp, variant in KINDS[:1]
            for p in ("first_forward", "topology")] + [
        (kind, sp, variant, point) for kind, sp, variant in KINDS for point in POINTS] + OWN_PATH


# Cases that once left our path for Megatron's unbounded collectives: a frozen weight's
# backward (its dgrad's reduction, no wgrad to hide it under), gather_output's gather.
OWN_PATH = [("column", True, "rs_dgrad_pipeline2+frozen", "backward"),
            ("column", True, "ring+frozen", "backward"),
            ("column", False, "ring+frozen", "backward"),
            ("row", True, "pipeline2+frozen", "backward"),
            ("column", False, "ring+gather", "forward"),
            ("column", True, "ring+gather", "forward")]


EXIT_CASES = [  # (case, victim)
    (("column", True, "rs_dgrad_pipeline2", "first_forward"), 1),
    (("row", True, "pipeline2", "first_forward"), 0),  # the rank that hosts the store
    (("row", True, "pipeline2", "forward"), 1),
    (("column", True, "rs_dgrad_pipeline2", "backward"), 1),
    (("row", True, "pipeline2", "between"), 1),
]


def case_id(case: tuple) -> str:
    from helpers.robust import kind_id

    mods = "".join(f"-{m}" for m in case[2].split("+")[1:])
    return f"{kind_id(case[0], case[1])}{mods}-{case[3]}"


# What the wait that timed out is called, per transport: a torch_p2p handle's wait
# names its peers; a symm wait is a signal from one peer, a staging barrier or the
# barrier every symm pass starts with (so on symm every pass waits for every peer).
_WAITED = {
    "torch_p2p": r"'(?P<layer>qkv|proj)_(?P<pass>fprop|dgrad|wgrad|gather_output)' chunk \d+ "
                 r"\((all ranks|to \d+, from \d+)\) and it failed: .*",
    "symm": r"(?:'[^']+' chunk \d+ \([^)]*\) and it failed: megatron_overlap\[symm\]: "
            r"rank \d+/\d+ waited for )?"  # the same, seen through a handle's wait()
            r"(the barrier starting )?'(?P<layer>qkv|proj)_(?P<pass>fprop|dgrad|wgrad|gather_output)' "
            r"(chunk \d+ from rank \d+|chunk \d+ \(staging barrier with ranks? [\d, ]+\)"
            r"|\(before chunk 0, with ranks? [\d, ]+\)) \(still pending after {t}s\)\. .*",
}
PASS_BARRIER = {"torch_p2p": False, "symm": True}


def _survivors(per_rank: list, victim: int) -> list[tuple[int, dict]]:
    out = []
    for r, (status, value) in enumerate(per_rank):
        if r != victim:
            assert status == "ok", f"rank {r} {status}: {value}"
            out.append((r, value))
    return out


def _check_pass_error(rank: int, world: int, got: dict, kind: str, point: str,
                      transport: str, t: float, exited: bool = False, variant: str = "") -> None:
    """The survivor's CommError names rank, layer pass, chunk and peer(s), and the pass
    is the one the victim left. `exited`: the victim's process ended; on a transport whose
    waits are on the GPU, its host may have left a pass while its GPU work for that pass
    was still queued, which dies with the process: the survivor is then truly stuck in
    that earlier pass (the forward, when the victim ended between the passes or inside
    its backward's host side: on the H200, column + SP, the victim's host had started 3
    backward transfers while its forward's chunk 1 signal was still queued), and its
    diagnosis names that one."""
    transfers = got["transfers"]
    if point != "forward" and transfers["backward"] == 0 and not PASS_BARRIER[transport]:
        assert got["result"] == "no error", got  # row without SP: no wait is left
        return
    pattern = (rf"CommError: megatron_overlap\[{transport}\]: rank {rank}/{world} waited for "
               + _WAITED[transport].replace("{t}", f"{t:g}") + rf"MEGATRON_OVERLAP_TIMEOUT_S={t:g}s")
    m = re.match(pattern, got["result"])
    assert m, got["result"]
    assert m.group("layer") == ("qkv" if kind == "column" else "proj")
    fails_in_forward = point == "forward" and (transfers["forward"] > 0 or PASS_BARRIER[transport])
    if exited and PASS_BARRIER[transport] and point in ("between", "backward") \
            and m.group("pass") == "fprop":
        return  # the victim's queued forward died with it (see the docstring)
    in_forward = m.group("pass") in ("fprop", "gather_output")
    assert in_forward == fails_in_forward, (point, transfers, got["result"])
    if "+frozen" in variant:  # no wgrad ran: the dgrad's reduction is named for the dgrad
        assert m.group("pass") == "dgrad", got["result"]
    if "+gather" in variant:  # the victim failed before the gather
        assert m.group("pass") == "gather_output", got["result"]


# The layer each case's first forward goes through (helpers.robust.pair names them so)
LAYER = {"column": "qkv (column)", "row": "proj (row)"}


def _first_forward_error(rank: int, world: int, victim: int, t: float, what: str,
                         layer: str | None) -> str:
    """The survivor's message; an exchange a layer makes names that layer first."""
    about = f"layer '{layer}': " if layer else ""
    return (f"CommError: megatron_overlap: {about}rank {rank}/{world} waited for '{what}' chunk 0 "
            f"(from all ranks) {t:g}s and group ranks {victim} (global {victim}) never arrived")


def check_raised(per_rank: list, case: tuple, transport: str, t: float, slack: float,
                 victim: int = 1) -> None:
    """The victim raised (and stayed alive, silent); every other rank got its diagnosis
    from its own timeout: within t plus slack, naming what it waited for."""
    kind, _, variant, point = case
    assert per_rank[victim][0] == "ok", per_rank[victim]
    assert per_rank[victim][1]["result"].startswith("Injected: injected failure"), per_rank[victim]
    world = len(per_rank)
    for rank, got in _survivors(per_rank, victim):
        if got["result"] != "no error":  # only its own timeout can have told it
            assert t * 0.9 <= got["elapsed"] <= t + slack, got
        if point in ("first_forward", "topology"):  # the topology exchange, outside a layer
            what, layer = {"first_forward": ("layer agreement (shape and settings)", LAYER[kind]),
                           "topology": ("topology exchange before the first forward", None)}[point]
            assert got["result"].startswith(
                _first_forward_error(rank, world, victim, t, what, layer)), got
            assert "a rank without install()" in got["result"]
        else:
            _check_pass_error(rank, world, got, kind, point, transport, t, variant=variant)


def check_exited(per_rank: list, case: tuple, victim: int, transport: str, t: float,
                 slack: float) -> None:
    """The victim's process ended; every other rank got a bounded diagnosis."""
    kind, _, _, point = case
    assert per_rank[victim] == ("exited", 17), per_rank[victim]
    world = len(per_rank)
    for rank, got in _survivors(per_rank, victim):
        assert got["elapsed"] <= t + slack, got
        if point != "first_forward":
            _check_pass_error(rank, world, got, kind, point, transport, t, exited=True)
        elif victim != 0:
            assert got["result"].startswith(_first_forward_error(
                rank, world, victim, t, "layer agreement (shape and settings)", LAYER[kind])), got
        else:
            assert got["result"].startswith(
                f"CommError: megatron_overlap: layer '{LAYER[kind]}': rank {rank}/{world} "
                f"waited for 'layer agreement "
                f"(shape and settings)' chunk 0 (from all ranks) {t:g}s and the rendezvous store "
                f"(hosted by global rank 0) is unreachable"), got
