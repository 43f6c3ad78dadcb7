"""Host time per overlapped layer call, through the public layers, by part.

Ranks share one GPU (gloo + torch symmetric memory) on one GPU, or take one GPU
each where there are enough: host time is valid either way (what the CPU spends
issuing a call), GPU time of shared-GPU ranks is not. Per TP size, the four TP
linears of one transformer layer (qkv, proj, fc1, fc2; hidden H, T tokens,
TE's default settings) are built with `install()` and Megatron's constructor,
then each pass is timed two ways, with whole-pass CUDA-graph replay off (the eager
schedule, every launch from Python) and on (`overlap.replay`, the default), side
by side in one run:

- first-call latency: the device drained (and the ranks lined up) before the
  call, `perf_counter` around `layer(x)` / `out.backward(g)`, no sync inside;
- back-to-back: `--inner` forward+backward calls queued as a training step
  queues them, one sync at the end; host time per call; with every rank issuing at
  once (as training does), and staggered (one rank at a time while the others sleep
  in a barrier: ranks sharing one machine's CPUs then do not slow each other down,
  as ranks with their own GPU and cores would not);
- one transformer layer's four linears chained (qkv -> proj -> fc1 -> fc2), then one
  backward through all of them, as a model runs them (one autograd-engine call per
  backward, not per linear); ours against Megatron's own linears on a one-rank group
  (no communication: what any autograd TP linear costs on this host).

`--profile` adds a cProfile of rank 0's calls (every rank runs them), each function's own time sorted
into parts (GEMM launches, copies, signal kernels, stream/event calls, views,
trace/stats/watchdog, autograd, Python); `--primitives` times the CUDA calls
alone. The schedule alone on `null` (no transport) is timed too.

    python benchmarks/host_time.py --tp 2 4 8 [--backend symm] [--profile] [--primitives]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import faulthandler
import json
import os
import pstats
import signal
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")

from megatron_overlap.ab.launch import init_dist, launch, plan_layout  # noqa: E402

from megatron_overlap.config.backends import AUTO, BACKENDS  # noqa: E402
from megatron_overlap.config.names import COLUMN_BUFFERS  # noqa: E402

# one transformer layer's four TP linears, in their dataflow order: (buffer name, kind,
# output or input width / hidden); the names are config.names' buffers
MULT = {"qkv": 3, "proj": 1, "fc1": 4, "fc2": 4}
LAYERS = tuple((n, "column" if n in COLUMN_BUFFERS else "row", m) for n, m in MULT.items())

# cProfile entries -> parts; first match wins (builtins are matched by name).
# symm's pybind calls (put_signal, wait_signal, barrier, get_buffer) are not profiled
# apart: they count in the own time of the symm functions that make them.
PARTS = (
    ("GEMM launch", ("torch.mm", "torch.bmm", "torch.matmul", "'addmm'", "'baddbmm'")),
    ("graph replay", ("graphs.py", "'replay'")),
    ("symm: signal kernels, peer views", ("symm.py", "put_signal", "wait_signal", "get_buffer")),
    ("copies / reductions", ("'copy_'", "'add_'", "'fill_'", "'zero_'", "'sum'", "'add'", "'clone'")),
    ("stream / event", ("wait_stream", "wait_event", "'record'", "Event", "Stream", "stream",
                        "capturing", "priority_range", "synchronize", "current_device")),
    ("views / allocation", ("get_buffer", "'view'", "'split'", "'unbind'", "'reshape'", "'t'",
                            "'expand'", "'new_empty'", "'empty'", "'data_ptr'", "'contiguous'",
                            "'is_contiguous'", "'element_size'", "'numel'", "'__getitem__' of 'torch",
                            "'storage_offset'", "get_signal_pad")),
    ("trace / stats / watchdog", ("comm/trace.py", "comm/stats.py", "comm/watchdog.py")),
    ("autograd", ("'apply'", "run_backward", "_engine_run_backward", "autograd")),
)


def _part(key: tuple) -> str:
    filename, _, name = key
    text = f"{filename}:{name}" if filename != "~" else name
    for part, needles in PARTS:
        if any(n in text for n in needles):
            return part
    return "Python (ours, torch, Megatron)"


def breakdown(prof: cProfile.Profile, calls: int) -> tuple[dict[str, float], list]:
    """µs per call by part, from each function's own (exclusive) time; and the 12
    functions with the most own time (name, µs per call, calls per call)."""
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    out: dict[str, float] = {}
    for key, (_, _, tottime, _, _) in stats.items():
        part = _part(key)
        out[part] = out.get(part, 0.0) + tottime * 1e6 / calls
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:12]
    named = [(f"{os.path.basename(k[0])}:{k[1]}({k[2]})" if k[0] != "~" else k[2],
              round(v[2] * 1e6 / calls, 1), round(v[1] / calls, 1)) for k, v in top]
    return dict(sorted(out.items(), key=lambda kv: -kv[1])), named


def build(tp: int, hidden: int, dtype: torch.dtype, device: torch.device, backend: str):
    import megatron_overlap
    from megatron.core.transformer import TransformerConfig

    megatron_overlap.install(None, backend=backend)  # Megatron's constructors now build ours

    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=32,
                               tensor_model_parallel_size=tp, sequence_parallel=tp > 1,
                               tp_comm_overlap=tp > 1, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                               use_cpu_initialization=device.type == "cpu",
                               gradient_accumulation_fusion=False, perform_initialization=True)
    return _four_linears(config, hidden, 1, device)


def _four_linears(config, hidden: int, split: int, device: torch.device, **kw) -> dict:
    """LAYERS built with Megatron's constructors (ours where install()'s swap applies):
    widths divided by `split` (1: the layer splits itself over its TP group)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    out = {}
    for name, kind, mult in LAYERS:
        wide = mult * hidden // split
        if kind == "column":
            layer = ColumnParallelLinear(hidden, wide, gather_output=False, config=config,
                                         init_method=torch.nn.init.xavier_normal_, bias=False,
                                         skip_bias_add=True, tp_comm_buffer_name=name, **kw)
        else:
            layer = RowParallelLinear(wide, hidden, input_is_parallel=True, config=config,
                                      init_method=torch.nn.init.xavier_normal_, bias=False,
                                      skip_bias_add=True, tp_comm_buffer_name=name, **kw)
        out[name] = layer.to(device)
    return out


_stage_s = 0.0  # --stage-timeout, in each rank
_stacks = None  # this rank's stack file (kept open: faulthandler writes to its descriptor)


def _stacks_path(out: str, rank: int) -> str:
    return f"{out}.rank{rank}.stacks"


def _watch_stages(out: str, rank: int) -> None:
    """Where this rank's stacks go if a stage outlasts --stage-timeout: its own file, on
    its own timer, and also when the launcher ends it because another rank's timer fired
    first (SIGTERM), so the rank that really hangs is never lost."""
    global _stacks
    if _stage_s > 0:
        _stacks = open(_stacks_path(out, rank), "w")
        faulthandler.register(signal.SIGTERM, file=_stacks, all_threads=True, chain=True)


def _stage(what: str) -> None:
    """A stage starts: rank 0 says which (a run cut short shows how far it got), and a
    stage that outlasts --stage-timeout dumps every thread's stack on every rank and
    ends the ranks (a hang then says where it is, and the next TP still runs)."""
    if dist.is_initialized() and dist.get_rank() == 0:
        print(f"  TP={dist.get_world_size()} {what}", flush=True)
    if _stacks is not None:
        faulthandler.dump_traceback_later(_stage_s, exit=True, file=_stacks)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _drained(device: torch.device) -> None:
    _sync(device)
    dist.barrier()


def _waits_on_device(layer) -> bool:
    """Staggered turns need a transport whose waits are GPU-side (a host then never
    blocks on a peer inside a call); torch_p2p's (gloo's) block the host."""
    return layer.weight.is_cuda and layer.transport.name in ("symm", "nvshmem")


def _pass_graphs(layers) -> list:
    """Every captured-pass cache of `layers` (a dict or one layer): ours have them,
    Megatron's own linears have none."""
    layers = layers.values() if isinstance(layers, dict) else (layers,)
    return [pg for layer in layers for pg in getattr(layer, "pass_graphs", {}).values()]


def _counts(layers) -> tuple[int, int]:
    """(replays, captures) made so far by `layers`' passes; replays: launches of a graph
    captured at an earlier call (a capturing call is not one)."""
    pgs = _pass_graphs(layers)
    captures = sum(pg.captures for pg in pgs)
    return sum(pg.replays for pg in pgs) - captures, captures


@contextlib.contextmanager
def _no_captures(layers):
    """No new capture inside a staggered turn: a capture can block its host on its own
    queued GPU work (seen on the H200 at TP=8: rank 0 stopped in `capture_end` while its
    queued replays waited on ranks asleep in the turn barrier), so a signature first
    seen in a turn runs eagerly (`_counts` shows how many; `_settle` makes them rare)."""
    saved = [(pg, pg.capture_after) for pg in _pass_graphs(layers)]
    for pg, _ in saved:
        pg.capture_after = sys.maxsize
    try:
        yield
    finally:
        for pg, after in saved:
            pg.capture_after = after


def _turns(calls, device: torch.device, layers):
    """Staggered: each rank in turn runs `calls()` (its back-to-back calls, timed) while
    the other ranks sleep in a gloo barrier, so no other rank's host competes for the
    CPUs. Every rank makes the same calls in the same order; the GPU side pairs them up
    once every rank has had its turn (replayed passes and the symm transport's waits
    are on the GPU: a host never blocks on a peer inside a call). Replayed calls only: a
    turn of eager calls queues hundreds of launches behind GPU waits for ranks yet to come,
    and once the device's launch queue is full the host blocks inside a launch while those
    ranks sleep: a deadlock (seen on the H200 at TP=2 with 4 eager calls a turn). Returns
    what `calls()` returned on this rank."""
    mine = None
    with _no_captures(layers):
        for r in range(dist.get_world_size()):
            dist.barrier()
            if dist.get_rank() == r:
                mine = calls()
    _drained(device)
    return mine


def _median(values):
    return statistics.median(values) if values else None


def _b2b(fwd, bwd, n: int) -> tuple[list[float], list[float]]:
    """n forward+backward calls queued back to back: host µs of each forward, each backward."""
    f, b = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        y = fwd()
        t1 = time.perf_counter()
        bwd(y)
        t2 = time.perf_counter()
        f.append((t1 - t0) * 1e6)
        b.append((t2 - t1) * 1e6)
    return f, b


def time_layers(layers: dict, tokens: int, tp: int, hidden: int, dtype, device, reps: int,
                inner: int, profile: bool, replayed: bool) -> dict:
    from megatron_overlap.overlap import replay

    replay.set_enabled(replayed)
    res: dict = {}
    for name, kind, mult in LAYERS:
        layer = layers[name]
        k_in = hidden if kind == "column" else mult * hidden // tp
        rows = tokens // tp if kind == "column" else tokens
        n_out = mult * hidden // tp if kind == "column" else hidden
        out_rows = tokens if kind == "column" else tokens // tp
        x = torch.randn(rows, 1, k_in, device=device, dtype=dtype, requires_grad=True)
        g = torch.randn(out_rows, 1, n_out, device=device, dtype=dtype)
        _stage(f"{'replayed' if replayed else 'eager'} {name}: warm-up, first calls")
        for _ in range(3):  # warm-up: buffers sized, kernels chosen, graphs captured
            layer(x)[0].backward(g)
        fwd, bwd = [], []
        for _ in range(reps):
            _drained(device)
            t0 = time.perf_counter()
            y = layer(x)[0]
            fwd.append((time.perf_counter() - t0) * 1e6)
            _drained(device)
            t0 = time.perf_counter()
            y.backward(g)
            bwd.append((time.perf_counter() - t0) * 1e6)
        _drained(device)
        _stage(f"{'replayed' if replayed else 'eager'} {name}: back to back")
        f_b2b, b_b2b = _b2b(lambda: layer(x)[0], lambda y: y.backward(g), inner)
        _sync(device)
        f_st, b_st = [], []
        if replayed and _waits_on_device(layer):  # see _turns: replays only
            _stage(f"replayed {name}: staggered turns")
            f_st, b_st = _turns(lambda: _b2b(lambda: layer(x)[0], lambda y: y.backward(g), inner),
                                device, layer)
        med = _median
        row = dict(fwd_us=med(fwd), bwd_us=med(bwd), fwd_b2b_us=med(f_b2b), bwd_b2b_us=med(b_b2b),
                   fwd_staggered_us=med(f_st), bwd_staggered_us=med(b_st))
        if profile:
            for p, fn in (("fwd", lambda: layer(x)[0]), ("bwd", None)):
                prof = cProfile.Profile()
                for _ in range(reps):
                    _drained(device)
                    if p == "fwd":
                        prof.enable()
                        fn()
                        prof.disable()
                    else:
                        y = layer(x)[0]
                        _drained(device)
                        prof.enable()
                        y.backward(g)
                        prof.disable()
                row[f"{p}_parts_us"], row[f"{p}_top"] = breakdown(prof, reps)
        layer.transport.check()
        # graph launches per pass (PassGraphs.replays: a capturing call's launch included)
        row["replays"] = {p: g.replays for p, g in getattr(layer, "pass_graphs", {}).items()}
        res[name] = row
    return res


def chain(layers: dict, tokens: int, tp: int, hidden: int, dtype, device):
    """The four TP linears of one transformer layer in their dataflow (qkv -> its first
    h/tp columns -> proj -> fc1 -> fc2), as a training step runs them: the forwards one
    after another, then one backward through all four (one autograd-engine call for the
    layer, as in a model, not one per linear). Returns (forward fn, backward fn)."""
    rows = tokens // tp if layers["proj"].sequence_parallel else tokens
    x = torch.randn(rows, 1, hidden, device=device, dtype=dtype, requires_grad=True)
    g = torch.randn(rows, 1, hidden, device=device, dtype=dtype)
    width = layers["proj"].weight.shape[1]

    def fwd():
        q = layers["qkv"](x)[0]
        return layers["fc2"](layers["fc1"](layers["proj"](q[..., :width])[0])[0])[0]

    return fwd, (lambda y: y.backward(g))


def megatron_layers(tp: int, hidden: int, dtype, device) -> dict:
    """Megatron's own ColumnParallelLinear / RowParallelLinear (tp_comm_overlap off) at
    this rank's GEMM shapes on a one-rank group: no communication at all, so their host
    time is what any autograd TP linear pays on this host (the floor to compare with)."""
    from megatron.core.transformer import TransformerConfig

    mine = None
    for r in range(dist.get_world_size()):  # new_group is collective
        grp = dist.new_group([r])
        mine = grp if r == dist.get_rank() else mine
    config = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=32,
                               params_dtype=dtype, bf16=dtype == torch.bfloat16,
                               use_cpu_initialization=device.type == "cpu",
                               gradient_accumulation_fusion=False, perform_initialization=True)
    return _four_linears(config, hidden, tp, device, tp_group=mine)


def time_chain(layers: dict, calls: tuple, inner: int, staggered: bool) -> dict:
    """Host µs per layer call inside `calls` (`chain`'s forward and backward, built once
    per set of layers so that every arm sees the same tensors), divided by 4, back to
    back; `staggered`: the ranks in turns (see _turns). Also how many of the timed
    passes replayed and how many were captured while timed (0 once addresses settle)."""
    from megatron_overlap.overlap import replay

    fwd, bwd = calls
    device = next(iter(layers.values())).weight.device
    _stage(f"chain ({'megatron' if not _pass_graphs(layers) else 'ours'}, "
           f"replay {'on' if replay.enabled() else 'off'}, {'staggered' if staggered else 'concurrent'})")
    settled = _settle(layers, fwd, bwd, inner, device)
    _drained(device)
    f: list[float] = []
    b: list[float] = []
    before = _counts(layers)
    if not staggered:
        f, b = _b2b(fwd, bwd, inner)
        _sync(device)
    elif all(not hasattr(layer, "overlap_plan") or (_waits_on_device(layer) and replay.enabled())
             for layer in layers.values()):  # Megatron's own linears (no comm), or our replays
        f, b = _turns(lambda: _b2b(fwd, bwd, inner), device, layers)
    after = _counts(layers)
    per = lambda v: _median(v) and _median(v) / len(LAYERS)  # noqa: E731
    return dict(fwd_us=per(f), bwd_us=per(b), passes=len(f) * 2 * len(LAYERS) if f else 0,
                replays=after[0] - before[0], captures=after[1] - before[1], settled=settled)


def _settle(layers, fwd, bwd, inner: int, device: torch.device, rounds: int = 6) -> bool:
    """Warm up with the timed loop's own pattern (`_b2b`: the previous output alive while
    the next is allocated) until a round of `inner` calls is replays alone on every rank (a
    signature first seen late in a round runs eagerly and captures nothing yet: only all
    calls replayed says the addresses settled), at most `rounds` rounds; True if one was.
    With replay off, or no passes of ours: a short warm-up. Every rank makes the same
    number of calls (a pass's transfers pair up across ranks)."""
    from megatron_overlap.overlap import replay

    pgs = _pass_graphs(layers)
    if not (replay.enabled() and pgs):  # nothing to capture
        _b2b(fwd, bwd, 4)
        return True
    for _ in range(rounds):
        calls, (replays, _) = sum(pg.calls for pg in pgs), _counts(layers)
        _b2b(fwd, bwd, inner)
        all_replayed = _counts(layers)[0] - replays == sum(pg.calls for pg in pgs) - calls
        # every rank agrees to stop (a tensor where the default group's backend takes one)
        done = torch.tensor([float(all_replayed)],
                            device=device if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(done, op=dist.ReduceOp.MIN)
        if done.item():
            return True
    return False


def time_null(tokens: int, tp: int, hidden: int, dtype, device, reps: int) -> dict:
    """The schedule alone on the null transport (nothing moved): ring AG at TP chunks
    (qkv's shape), pipeline RS at 4 chunks (proj's), eager and replayed, device drained
    before each call and back to back."""
    from megatron_overlap.comm import NullTransport
    from megatron_overlap.overlap import replay
    from megatron_overlap.overlap.pass_fn import pass_fn
    from megatron_overlap.overlap.streams import ChunkStreams
    from megatron_overlap.tune.measure import host_us

    x_ag = torch.randn(tokens // tp, hidden, device=device, dtype=dtype)
    w_ag = torch.randn(3 * hidden // tp, hidden, device=device, dtype=dtype)
    x_rs = torch.randn(tokens, hidden // tp, device=device, dtype=dtype)
    w_rs = torch.randn(hidden, hidden // tp, device=device, dtype=dtype)
    out = {}
    for replayed in (False, True):
        replay.set_enabled(replayed)  # the global switch too: an earlier arm may have left it off
        null = NullTransport(tp)
        cases = {f"ring AG, {tp} chunks": pass_fn(x_ag, w_ag, null, "ag", "ring_exchange", tp,
                                                  name="qkv_fprop", streams=ChunkStreams(),
                                                  replay=replayed),
                 "pipeline RS, 4 chunks": pass_fn(x_rs, w_rs, null, "rs", "pipeline", 4,
                                                  name="proj_fprop", streams=ChunkStreams(),
                                                  replay=replayed)}
        for name, fn in cases.items():
            for _ in range(3):
                fn()
            drained, b2b = host_us(fn, reps), []  # median, device drained before each call
            for _ in range(reps):
                t0 = time.perf_counter()
                fn()
                b2b.append((time.perf_counter() - t0) * 1e6)
            torch.cuda.synchronize(device)
            out[f"{name} ({'replayed' if replayed else 'eager'})"] = dict(
                drained_us=drained, b2b_us=statistics.median(b2b),
                replays=getattr(fn, "graphs", None) and fn.graphs.replays)
    return out


def primitives(device: torch.device, reps: int = 200) -> dict[str, float]:
    """Host µs of single CUDA calls on this machine (median, device mostly idle)."""
    a = torch.randn(512, 4096, device=device, dtype=torch.bfloat16)
    b = torch.randn(1280, 4096, device=device, dtype=torch.bfloat16)
    o = torch.empty(512, 1280, device=device, dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    small = torch.empty(1 << 14, device=device)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(8):
            torch.matmul(a, b.t(), out=o)
    calls = {
        "torch.matmul (out=)": lambda: torch.matmul(a, b.t(), out=o),
        "tensor.add_ (tiny kernel)": lambda: small.add_(1.0),
        "tensor.copy_ 64 KiB": lambda: small.copy_(small),
        "torch.empty": lambda: torch.empty(1 << 20, device=device),
        "Event() + record": lambda: torch.cuda.Event().record(),
        "stream.wait_stream": lambda: s.wait_stream(torch.cuda.current_stream()),
        "with torch.cuda.stream(s)": lambda: torch.cuda.stream(s).__enter__() or torch.cuda.stream(
            torch.cuda.default_stream()).__enter__(),
        "graph replay (8 GEMMs)": g.replay,
    }
    out = {}
    for name, fn in calls.items():
        ts = []
        for i in range(reps):
            if i % 20 == 0:
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
        out[name] = statistics.median(ts)
    torch.cuda.synchronize(device)
    return out


def _rank(rank: int, world: int, args) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    global _stage_s
    _stage_s = args.stage_timeout
    _watch_stages(args.out, rank)
    layout = plan_layout(world, args.device)
    device = init_dist(layout, rank)
    if device.type == "cpu":  # megatron-core on CPU: the test suite's shims (never in the library)
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
        from helpers.megatron_cpu import init

        init(world, 0)
    else:
        parallel_state.destroy_model_parallel()
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
        model_parallel_cuda_manual_seed(0)
    dtype = getattr(torch, args.dtype)
    _stage("build")
    layers = build(world, args.hidden, dtype, device, args.backend)
    row = dict(tp=world, layout=layout.note)
    for mode, replayed in (("eager", False), ("replay", True)):
        row[mode] = time_layers(layers, args.tokens, world, args.hidden, dtype, device, args.reps,
                                args.inner, args.profile, replayed)
    from megatron_overlap.overlap import replay

    _stage("Megatron's linears on one-rank groups")
    mcore = megatron_layers(world, args.hidden, dtype, device)
    ours_calls = chain(layers, args.tokens, world, args.hidden, dtype, device)
    mcore_calls = chain(mcore, args.tokens, world, args.hidden, dtype, device)
    for mode, replayed, chain_of, calls in (("eager", False, layers, ours_calls),
                                            ("replay", True, layers, ours_calls),
                                            ("megatron", False, mcore, mcore_calls)):
        replay.set_enabled(replayed)
        row[f"chain_{mode}"] = {how: time_chain(chain_of, calls, args.inner, how == "staggered")
                                for how in ("concurrent", "staggered")}
    _stage("null schedules, primitives (rank 0)")
    if rank == 0:
        row["null"] = (time_null(args.tokens, world, args.hidden, dtype, device, args.reps)
                       if device.type == "cuda" else {})
        if args.primitives and device.type == "cuda":
            row["primitives_us"] = primitives(device)
        with open(args.out + f".tp{world}", "w") as f:
            json.dump(row, f)
    dist.barrier()
    faulthandler.cancel_dump_traceback_later()
    dist.destroy_process_group()
    if _stacks is not None:  # nothing hung: no stacks to keep
        faulthandler.unregister(signal.SIGTERM)
        _stacks.close()
        os.remove(_stacks.name)


def _us(v: float | None, width: int) -> str:
    return f"{v:{width}.0f}" if v is not None else f"{'-':>{width}s}"


def _replayed(arm: dict) -> int:
    """An arm's replays without its capturing calls; files written before `settled` existed
    counted a capturing call as a replay too."""
    return arm["replays"] if "settled" in arm else arm["replays"] - arm["captures"]


def report(meta: dict, rows: list) -> None:
    """Print the tables of one run (`meta`, `rows` as the --out file holds them)."""
    backend = meta["backend"]
    print(f"{meta['device']}  torch {meta['torch']}  backend {backend}  hidden {meta['hidden']}  "
          f"{meta['tokens']} tokens  {meta['dtype']}; host µs per call, median")
    print(f"{'TP':>3s} {'layer':6s} {'mode':7s} {'fwd':>7s} {'bwd':>7s} {'fwd b2b':>8s} "
          f"{'bwd b2b':>8s} {'fwd stg':>8s} {'bwd stg':>8s}  (first call: device drained before "
          "it; b2b: back to back, all ranks at once; stg: back to back, one rank at a time)")
    for r in rows:
        for mode in ("eager", "replay"):
            for name, v in r[mode].items():
                print(f"{r['tp']:3d} {name:6s} {mode:7s} {_us(v['fwd_us'], 7)} {_us(v['bwd_us'], 7)} "
                      f"{_us(v['fwd_b2b_us'], 8)} {_us(v['bwd_b2b_us'], 8)} "
                      f"{_us(v.get('fwd_staggered_us'), 8)} {_us(v.get('bwd_staggered_us'), 8)}  "
                      f"graph launches {v.get('replays')}")
        for name, v in r.get("null", {}).items():
            print(f"{r['tp']:3d} null {name}: drained {v['drained_us']:.0f}, b2b {v['b2b_us']:.0f}"
                  + (f", replays {v['replays']}" if v.get("replays") is not None else ""))
    print("\none transformer layer's four TP linears in their dataflow, one backward for all "
          "four; host µs per linear call, back to back (concurrent: all ranks at once; "
          "staggered: one rank at a time); megatron: Megatron's own linears, no communication")
    print(f"{'TP':>3s} {'arm':9s} {'fwd conc':>9s} {'bwd conc':>9s} {'fwd stg':>8s} {'bwd stg':>8s}")
    for r in rows:
        for mode in ("eager", "replay", "megatron"):
            c = r.get(f"chain_{mode}")
            if c is None:  # runs before the chain existed
                continue
            hits = "".join(f"  {how}: {_replayed(c[how])}/{c[how]['passes']} replayed, "
                           f"{c[how]['captures']} captured"
                           + ("" if c[how].get("settled", True) else " (warm-up never settled)")
                           for how in ("concurrent", "staggered")
                           if mode == "replay" and c[how].get("passes"))
            print(f"{r['tp']:3d} {mode:9s} {_us(c['concurrent']['fwd_us'], 9)} "
                  f"{_us(c['concurrent']['bwd_us'], 9)} {_us(c['staggered']['fwd_us'], 8)} "
                  f"{_us(c['staggered']['bwd_us'], 8)}{hits}")
    for r in rows:
        for mode in ("eager", "replay"):
            for name, v in r[mode].items():
                for p in ("fwd", "bwd"):
                    if f"{p}_parts_us" in v:
                        parts = ", ".join(f"{k} {u:.0f}" for k, u in v[f"{p}_parts_us"].items()
                                          if u >= 1)
                        print(f"TP={r['tp']} {name} {mode} {p} (cProfile µs/call): {parts}")
                        if name == "fc1" and v.get(f"{p}_top"):
                            print("    top own time (µs, calls): " + "; ".join(
                                f"{n} {u} x{c}" for n, u, c in v[f"{p}_top"][:10]))
        if "primitives_us" in r:
            print("primitives (µs): " + ", ".join(f"{k} {v:.1f}" for k, v in r["primitives_us"].items()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--backend", default="symm", choices=(AUTO,) + BACKENDS)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--inner", type=int, default=20, help="back-to-back calls")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--primitives", action="store_true")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a functional run only (no host time worth reporting: no GPU launches)")
    ap.add_argument("--out", default="benchmarks/results/host_time.json")
    ap.add_argument("--stage-timeout", type=float, default=180.0, metavar="S",
                    help="a stage (one layer's calls of one kind, a chain, ...) that takes longer "
                    "dumps every rank's stack and ends that TP's run; the next TP still runs "
                    "(0: never)")
    ap.add_argument("--report", metavar="JSON", help="print the tables of an earlier run's --out file "
                    "(also one cut short: it holds every TP that finished) and exit")
    args = ap.parse_args()
    if args.report:
        with open(args.report) as f:
            doc = json.load(f)
        report(doc["meta"], doc["rows"])
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("host_time.py needs a CUDA GPU (host time of GPU launches); "
                         "--device cpu runs it for function only")
    if args.device == "cpu":
        print("FUNCTIONAL ONLY: CPU run, host times of no GPU launches")
    rows = []
    meta = dict(device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                torch=torch.__version__, backend=args.backend,
                hidden=args.hidden, tokens=args.tokens, dtype=args.dtype, reps=args.reps,
                date=time.strftime("%Y-%m-%d %H:%M:%S"))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    for tp in args.tp:  # each TP's rows written as soon as they are in: a run cut short keeps them
        t0 = time.perf_counter()
        try:
            launch(_rank, tp, args, device=args.device)
        except Exception as exc:  # a rank failed or hit --stage-timeout
            print(f"TP={tp} FAILED after {time.perf_counter() - t0:.0f} s: {type(exc).__name__}: "
                  f"{exc}", flush=True)
            for r in range(tp):  # where each rank was (its timer fired, or it was ended)
                path = _stacks_path(args.out, r)
                if os.path.exists(path):
                    with open(path) as f:
                        print(f"--- TP={tp} rank {r}: stacks\n{f.read().rstrip()}", flush=True)
                    os.remove(path)
            continue
        with open(args.out + f".tp{tp}") as f:
            rows.append(json.load(f))
        os.remove(args.out + f".tp{tp}")
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        print(f"TP={tp} done in {time.perf_counter() - t0:.0f} s -> {args.out}", flush=True)
    report(meta, rows)
    print(f"full results: {args.out}")


if __name__ == "__main__":
    main()
