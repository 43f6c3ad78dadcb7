"""Whole layer passes replayed from CUDA graphs (`overlap.replay`) through the public
layers on `symm`: every call equals the eager pass bit for bit and Megatron's own
layer within tolerance; token counts change between calls; fused wgrad
accumulates; a peer that never answers a replayed pass is diagnosed."""

import pytest

from helpers import dist, gpu

CASES = [  # (kind, variant of helpers.layers.VARIANTS, bias, gradient_accumulation_fusion)
    ("column", "ring", True, False), ("column", "ring_aggregate", False, True),
    ("column", "rs_dgrad_pipeline2", False, False), ("column", "no_bulk_bwd", True, False),
    ("row", "pipeline2", True, False), ("row", "ring", False, True),
    ("row", "ring_dgrad_aggregate", False, False),
]


def _init(world):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    device = gpu.init()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model_parallel_cuda_manual_seed(0)
    return device


def _step(layer, x, dy):
    """One forward + backward; what it produced, copied to the host (the originals are
    freed, so the next call's allocations land where these did, as in training, which
    keeps nothing of a step on the device: device copies kept across steps would take
    blocks the passes' tensors had used and move them, as they did to FP8 layers)."""
    import torch

    xi = x.detach().requires_grad_(True)
    for p in layer.parameters():
        p.grad = None
    y, _ = layer(xi)
    y.backward(dy)
    out = {"y": y.detach().cpu(), "dx": xi.grad.cpu(),
           "dw": None if layer.weight.grad is None else layer.weight.grad.cpu()}
    if layer.bias is not None:
        out["db"] = layer.bias.grad.cpu()
    if hasattr(layer.weight, "main_grad"):
        out["main_grad"] = layer.weight.main_grad.cpu()
    del y, xi
    torch.cuda.synchronize()
    return out


def _replay_vs_eager(rank, world):
    import torch

    from helpers.layers import VARIANTS, Case, build_pair, make_input
    from megatron_overlap.overlap import replay

    _init(world)
    errs, counts = {}, {}
    for kind, variant, bias, fuse in CASES:
        case = Case(kind, True, "bfloat16", bias, False, variant, seq=64, batch=2)
        overrides, flags = VARIANTS[kind][variant]
        ref, ours = build_pair(case, world, overrides, {**flags, "gradient_accumulation_fusion": fuse})
        ref, ours = ref.cuda(), ours.cuda()
        if fuse:
            ours.weight.main_grad = torch.zeros(ours.weight.shape, dtype=torch.float32, device="cuda")
        before = replay.totals()
        for seq in (64, 32, 64):  # a new token count, then back to the first
            # Fixed buffers refilled with new values every step: a replay that left an
            # output unwritten, or read stale inputs, would not equal eager.
            x = make_input(case, rank, world, ours, seq=seq, seed=seq).detach().cuda()
            with torch.no_grad():
                dy = torch.empty(ours(x)[0].shape, dtype=x.dtype, device="cuda")
            g = torch.Generator().manual_seed(seq + 100 * rank)
            values = [(torch.randn(x.shape, generator=g).to(x.dtype).cuda(),
                       torch.randn(dy.shape, generator=g).to(x.dtype).cuda()) for _ in range(4)]
            grad0 = torch.randn(ours.weight.shape, generator=g).cuda() if fuse else None

            def steps():  # as training runs them: eager, capture, replays
                out = []
                for xv, dv in values:
                    x.copy_(xv)
                    dy.copy_(dv)
                    if fuse:  # accumulation onto non-zero grads, not an overwrite
                        ours.weight.main_grad.copy_(grad0)
                    out.append(_step(ours, x, dy))
                return out
            got = steps()
            replay.set_enabled(False)
            try:
                eager = steps()
            finally:
                replay.set_enabled(None)
            mega = _step(ref, x, dy)  # the last values
            for i, (step, ref_step) in enumerate(zip(got, eager)):
                for key, val in step.items():
                    if val is None or ref_step[key] is None:  # dW in main_grad: both None
                        errs[(kind, variant, seq, i, key, "eager")] = 0.0 if val is ref_step[key] else 1.0
                    else:
                        errs[(kind, variant, seq, i, key, "eager")] = (val - ref_step[key]).abs().max().item()
            for key in ("y", "dx", "db"):
                if key in got[-1]:
                    errs[(kind, variant, seq, key, "megatron")] = gpu.rel(got[-1][key], mega[key])
        counts[(kind, variant)] = {p: (g.replays, g.captures) for p, g in ours.pass_graphs.items()}
        # every call counted, replayed or not: 3 token counts x (1 sizing forward + 4 steps
        # replay on + 4 off) forwards, 3 x 8 backwards; the process's totals (telemetry's
        # source) moved by exactly this layer's calls (Megatron's layer has no passes), its
        # replays there being launches of a graph captured at an earlier call
        calls = {p: g.calls for p, g in ours.pass_graphs.items()}
        assert calls == {"fprop": 27, "bwd": 24}, calls
        after = replay.totals()
        launched, captured = (sum(c[i] for c in counts[(kind, variant)].values()) for i in (0, 1))
        assert {k: after[k] - before[k] for k in after} == \
            {"calls": 51, "replays": launched - captured, "captures": captured, "evictions": 0}, \
            (before, after)
    ours.transport.check()
    return errs, counts


@pytest.mark.parametrize("world", [2, 4])
def test_public_layers_replay_equal_eager(world):
    for errs, counts in dist.run(_replay_vs_eager, world, env=gpu.ENV, timeout=400):
        bad = {k: v for k, v in errs.items()
               if (k[-1] == "eager" and v != 0.0) or (k[-1] == "megatron" and not v <= 1e-2)}
        assert errs and not bad, bad
        print("replays, captures per pass:", counts)
        # Replays happen where a pass's tensors recur at the same addresses (steady
        # state): every case replays both passes, and stored graphs are replayed again
        # (more replays than captures), a row layer's bias included (added inside its pass)
        for (kind, variant), passes in counts.items():
            assert sum(replays for replays, _ in passes.values()) >= 2, (variant, passes)
            assert all(r > c for r, c in passes.values()), (kind, variant, passes)


def _silent_peer_in_replay(rank, world):
    import torch
    import torch.distributed as tdist

    from helpers.layers import VARIANTS, Case, build_pair, make_input
    from megatron_overlap.comm import CommError

    _init(world)
    case = Case("column", True, "bfloat16", False, False, "ring", seq=64, batch=2)
    _, ours = build_pair(case, world, *VARIANTS["column"]["ring"])
    ours = ours.cuda()
    x = make_input(case, rank, world, ours, seq=64).cuda()
    with torch.no_grad():
        for _ in range(3):  # eager, capture + replay, replay
            ours(x)
    torch.cuda.synchronize()
    tdist.barrier()
    message = None
    if rank == 0:  # rank 1 never calls: rank 0's replay waits for it
        try:
            with torch.no_grad():
                ours(x)
            torch.cuda.synchronize()
        except RuntimeError:
            pass
        try:
            ours.transport.check()
        except CommError as exc:
            message = str(exc)
    tdist.barrier()
    return message, ours.pass_graphs["fprop"].replays


def test_silent_peer_in_a_replayed_pass_is_diagnosed():
    env = {**gpu.ENV, "CUDA_DEVICE_MAX_CONNECTIONS": "8", "MEGATRON_OVERLAP_TIMEOUT_S": "3"}
    message, replays = dist.run(_silent_peer_in_replay, 2, env=env, timeout=90)[0]
    assert replays >= 2
    assert message is not None and "CUDA-graph replay of" in message, message
    assert "'qkv_fprop' chunk 1 from rank 1" in message and "rank 0/2" in message, message


def _moved_to_another_transport(rank, world):
    """A layer whose passes replay, moved to a second symm transport (same kind, same
    workspace generation, other workspaces): its next call must not launch a graph that
    reads and writes the first transport's workspaces."""
    import torch

    from helpers.layers import VARIANTS, Case, build_pair, make_input

    _init(world)
    case = Case("column", True, "bfloat16", False, False, "ring", seq=64, batch=2)
    overrides, flags = VARIANTS["column"]["ring"]
    ref, ours = build_pair(case, world, overrides, flags)
    ref, ours = ref.cuda(), ours.cuda()
    x = make_input(case, rank, world, ours, seed=3).detach().cuda()
    with torch.no_grad():
        dy = torch.randn(ours(x)[0].shape, generator=torch.Generator().manual_seed(rank)).to(x.dtype).cuda()
    for _ in range(4):
        _step(ours, x, dy)
    first = {p: g.replays for p, g in ours.pass_graphs.items()}
    ours._transport = gpu.symm()
    got = _step(ours, x, dy)
    moved = {p: g.replays for p, g in ours.pass_graphs.items()}
    for _ in range(3):
        got = _step(ours, x, dy)
    again = {p: g.replays for p, g in ours.pass_graphs.items()}
    mega = _step(ref, x, dy)
    return first, moved, again, {k: gpu.rel(got[k], mega[k]) for k in ("y", "dx")}


def test_a_pass_graph_replays_only_on_its_own_transport():
    for first, moved, again, errs in dist.run(_moved_to_another_transport, 2, env=gpu.ENV, timeout=240):
        assert all(n > 0 for n in first.values()), first  # replaying on the first transport
        assert moved == first, (first, moved)  # the call after the move ran its pass anew
        assert all(again[p] > moved[p] for p in again), (moved, again)  # then replays its own
        assert all(e <= 1e-2 for e in errs.values()), errs


def _pool_after_steps(rank, world):
    """A column layer under SP whose backward gathers a 256 MiB input: what the pass
    graphs' scratch pool reserves after steps with its weight frozen (the backward gathers
    nothing: it only reduce-scatters the dgrad), then after steps training it (the backward
    gathers the input for the wgrad), its passes replayed in both."""
    import torch

    import megatron_overlap as mo
    from helpers.layers import Case, build, make_input
    from megatron_overlap.overlap import replay

    _init(world)
    case = Case("column", True, "bfloat16", False, False, "default", seq=8192, batch=2)
    mo.install()
    try:
        ours = build(case, world, overlap=True, name_in=4096, name_out=256).cuda()
    finally:
        mo.uninstall()
    x = make_input(case, rank, world, ours, seed=5).detach().cuda()
    with torch.no_grad():
        dy = torch.randn(ours(x)[0].shape, generator=torch.Generator().manual_seed(rank)).to(x.dtype).cuda()
    pools, replays = [], []
    for frozen in (True, False):
        ours.weight.requires_grad_(not frozen)
        for _ in range(5):
            _step(ours, x, dy)
        pools.append(replay.pool_memory()[0])
        replays.append(ours.pass_graphs["bwd"].replays)
    gathered = world * x.numel() * x.element_size()
    return pools, gathered, replays


def test_the_column_backward_gather_is_not_kept_in_the_scratch_pool():
    """The backward's gathered input is allocated by the layer, outside the replayed pass:
    freed after each backward, as the eager pass's is, instead of held in the pass graphs'
    pool for the whole run, while the backward still replays. Training the weight (a
    gather in every backward) grows the pool by less than half the gather. (The layer
    runs install()'s default settings: TE's.)"""
    for (frozen, trained), gathered, replays in dist.run(_pool_after_steps, 2, env=gpu.ENV, timeout=240):
        assert gathered == 256 * 2 ** 20
        assert 0 < frozen <= trained, (frozen, trained)  # the pool is seen (the passes captured)
        assert 0 < replays[0] < replays[1], replays  # both kinds of backward replayed
        assert trained - frozen < gathered // 2, (frozen, trained, gathered)


WORKSPACE_CONFIG = ":4100:8"  # cuBLAS workspaces of a size no tensor here has
WORKSPACE_BYTES = 4100 * 1024 * 8


def _workspaces() -> tuple[int, int]:
    """(in the pass graphs' pool, elsewhere): the cuBLAS workspaces the process holds, as
    blocks allocated at the size CUBLAS_WORKSPACE_CONFIG gives them."""
    import torch

    from megatron_overlap.overlap import replay

    dev = torch.cuda.current_device()
    pool = tuple(replay._pools[dev][0]) if dev in replay._pools else None
    counts = [0, 0]
    for seg in torch.cuda.memory_snapshot():
        for block in seg["blocks"]:
            if block["state"] == "active_allocated" and \
                    block.get("requested_size", block["size"]) == WORKSPACE_BYTES:
                counts[tuple(seg.get("segment_pool_id", ())) != pool] += 1
    return counts[0], counts[1]


def _workspaces_after_steps(rank, world):
    """A column layer feeding a row layer under SP, TE's settings (GEMMs on three
    streams): the cuBLAS workspaces held after one eager step, then after steps that
    capture and replay every pass, and each pass's (captures, replays)."""
    import dataclasses

    import torch

    import megatron_overlap as mo
    from helpers.layers import Case, build, make_input

    _init(world)
    col_case = Case("column", True, "bfloat16", False, False, "default", seq=512, batch=2)
    row_case = dataclasses.replace(col_case, kind="row")
    mo.install()
    try:
        col = build(col_case, world, overlap=True, name_in=1024, name_out=1536).cuda()
        row = build(row_case, world, overlap=True, name_in=1024, name_out=1536).cuda()
    finally:
        mo.uninstall()
    x = make_input(col_case, rank, world, col, seed=5).detach().cuda()

    def step():
        xi = x.detach().requires_grad_(True)
        y = row(col(xi)[0])[0]
        y.backward(torch.ones_like(y))
        del y, xi
        torch.cuda.synchronize()

    step()
    eager = _workspaces()
    for _ in range(5):
        step()
    graphs = {f"{layer}.{p}": (g.captures, g.replays)
              for layer, m in (("column", col), ("row", row)) for p, g in m.pass_graphs.items()}
    return eager, _workspaces(), graphs


def test_captures_take_no_cublas_workspace():
    """A GEMM of a pass being captured never runs on the capture stream: it forks onto
    chunk stream 0, where its thread's chunk GEMMs made a cuBLAS workspace eagerly. So
    capturing takes none into the pass graphs' pool, and no more are held once every pass
    replays. (Before, the column backward's GEMMs, which run on the pass's stream, took
    one into the pool.)"""
    env = {**gpu.ENV, "CUBLAS_WORKSPACE_CONFIG": WORKSPACE_CONFIG}
    for eager, replayed, graphs in dist.run(_workspaces_after_steps, 2, env=env, timeout=240):
        assert all(c >= 1 and r >= 1 for c, r in graphs.values()), graphs  # every pass replays
        assert eager[0] == 0 and eager[1] >= 2, eager  # the forward thread's and autograd's at least
        assert replayed == (0, eager[1]), (eager, replayed)
