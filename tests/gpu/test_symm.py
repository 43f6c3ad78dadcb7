"""The `symm` transport with 2, 4 and 8 ranks sharing one GPU: every schedule
(method x num_splits x GEMM streams x dtype) and every pass of both layer kinds
equal a reference computed without overlap; 100 back-to-back iterations finish;
CUDA-graph replay equals eager; a peer that never signals is a CommError naming
rank, pass, chunk and peer."""

import pytest

from helpers import dist, gpu

AG = [("ring_exchange", False), ("ring_exchange", True), ("bulk", False)]
RS = [("pipeline", 1), ("pipeline", 2), ("pipeline", 4), ("ring_exchange", 1), ("bulk", 1)]
DTYPES = ("float32", "bfloat16", "float16")
ROWS, K, N = 32, 64, 48


def _schedules(rank, world, backend="symm", per_gpu=None):
    import torch

    from megatron_overlap.overlap import all_gather_matmul, matmul_reduce_scatter
    from megatron_overlap.overlap.streams import ChunkStreams

    gpu.init(per_gpu)
    tp = gpu.transport(backend)
    errs = {}
    blk = slice(rank * ROWS, (rank + 1) * ROWS)
    for dt in DTYPES:
        dtype = getattr(torch, dt)
        x_full, w = gpu.full(1, world * ROWS, K).to(dtype), gpu.full(2, N, K).to(dtype)
        parts = [gpu.full(10 + r, world * ROWS, K).to(dtype) for r in range(world)]
        ref_ag = x_full.float() @ w.float().t()
        ref_rs = sum(p.float() @ w.float().t() for p in parts)
        for streams in (1, 2):
            for method, agg in AG:
                tp.begin_pass("ag")
                y, g = all_gather_matmul(x_full[blk], w, tp, method, op="ag", aggregate=agg,
                                         streams=ChunkStreams(n=streams))
                errs[("ag", dt, streams, method, agg)] = (max(gpu.rel(y, ref_ag), gpu.rel(g, x_full)),
                                                          gpu.TOL[dtype])
            for method, splits in RS:
                for scatter in (True, False):
                    tp.begin_pass("rs")
                    y = matmul_reduce_scatter(parts[rank], w, tp, method, splits, op="rs",
                                              scatter=scatter, streams=ChunkStreams(n=streams))
                    ref = ref_rs[blk] if scatter else ref_rs
                    errs[("rs", dt, streams, method, splits, scatter)] = (gpu.rel(y, ref), gpu.TOL[dtype])
        tp.begin_pass("collectives")
        out = torch.empty_like(x_full)
        h1 = tp.all_gather(out, x_full[blk], op="ag_bulk")
        rs = torch.empty(ROWS, K, dtype=dtype, device=x_full.device)
        h2 = tp.reduce_scatter(rs, parts[rank], op="rs_bulk")
        ar = parts[rank].clone()
        h3 = tp.all_reduce(ar, op="ar_bulk")
        for h in (h1, h2, h3):
            h.wait()
        total = sum(p.float() for p in parts)
        errs[("all_gather", dt)] = (gpu.rel(out, x_full), 0.0)
        errs[("reduce_scatter", dt)] = (gpu.rel(rs, total[blk]), gpu.TOL[dtype])
        errs[("all_reduce", dt)] = (gpu.rel(ar, total), gpu.TOL[dtype])
    torch.cuda.synchronize()
    tp.check()
    return errs, tp.describe()


@pytest.mark.parametrize("world", [2, 4, 8])
def test_schedules_match_reference(world):
    per_rank = dist.run(_schedules, world, env=gpu.ENV, timeout=300)
    for errs, desc in per_rank:
        bad = {k: v for k, v in errs.items() if not v[0] <= v[1]}
        assert not bad, bad
        assert len(errs) == len(DTYPES) * (2 * (len(AG) + 2 * len(RS)) + 3)
        assert desc["transport"] == "symm" and desc["buffer_bytes"] > 0


@pytest.mark.parametrize("backend", ["symm", "torch_p2p", "nvshmem"])
@pytest.mark.parametrize("world", [2, 4, 8])
def test_schedules_one_rank_per_gpu(world, backend):
    """Issue 7's first table: every transport with one rank per GPU over NCCL."""
    import torch

    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, one per rank (missing hardware: "
                    f"{torch.cuda.device_count()} here)")
    if backend == "nvshmem":
        pytest.importorskip("nvshmem.core", reason="nvshmem4py is not installed (CUDA-only wheel)")
    env = {**gpu.ENV, "NVSHMEM_DISABLE_NVLS": "1", "NCCL_NVLS_ENABLE": "0",
           "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    for errs, desc in dist.run(_schedules, world, backend, True, env=env, timeout=300):
        bad = {k: v for k, v in errs.items() if not v[0] <= v[1]}
        assert not bad, bad
        assert desc["transport"] == backend


# -- layer passes: the autograd functions with the plans Megatron's flags give ---------------

def _layer_case(rank, world, kind, variant, dtype, seq_rows=ROWS, seed=0):
    """Inputs, weights and the reference fwd/bwd of one layer pass set (SP on)."""
    import torch

    n_full, k_full = N * world, K * world
    blk = slice(rank * seq_rows, (rank + 1) * seq_rows)
    x_full = gpu.full(seed + 1, world * seq_rows, K if kind == "column" else k_full)
    g_full = gpu.full(seed + 2, world * seq_rows, n_full if kind == "column" else N)
    if kind == "column":
        w_full = gpu.full(seed + 3, n_full, K)
        cols = slice(rank * N, (rank + 1) * N)
        w = w_full[cols]
        x, g = x_full[blk], g_full[:, cols]
        ref = dict(y=x_full @ w.t(), dx=(g_full @ w_full)[blk], dw=g.t() @ x_full)
    else:
        w_full = gpu.full(seed + 3, N, k_full)
        cols = slice(rank * K, (rank + 1) * K)
        w = w_full[:, cols]
        x, g = x_full[:, cols], g_full[blk]
        ref = dict(y=(x_full @ w_full.t())[blk], dx=g_full @ w, dw=g_full.t() @ x)
    cast = lambda t: t.to(getattr(torch, dtype)).contiguous()  # noqa: E731
    return cast(x), cast(w), cast(g), ref


def _plan(kind, variant, world):
    from megatron.core import ModelParallelConfig

    from helpers.layers import VARIANTS
    from megatron_overlap.layers.plan import build_plan
    from megatron_overlap.config import state

    ub, flags = VARIANTS[kind][variant]
    st = state.make(ub, "symm")
    config = ModelParallelConfig(tensor_model_parallel_size=world, sequence_parallel=True,
                                 tp_comm_overlap=True, **flags)
    return build_plan(config, "qkv" if kind == "column" else "proj", kind, sequence_parallel=True,
                      is_expert=False, settings=st.settings, rs_dgrad_settings=st.rs_dgrad_settings,
                      ring_n=0)  # (aggregate as the variant names it; auto: the plain ring)


def _run_layer(kind, x, w, g, plan, tp):
    from megatron_overlap.layers.functions import ColumnParallelMatmul, RowParallelMatmul

    x = x.detach().requires_grad_()
    w = w.detach().requires_grad_()
    if kind == "column":
        y = ColumnParallelMatmul.apply(x, w, None, plan, tp, False, False)
    else:
        y = RowParallelMatmul.apply(x, w, None, plan, tp, False)
    y.backward(g)
    return dict(y=y.detach(), dx=x.grad, dw=w.grad)


def _layers(rank, world):
    from helpers.layers import VARIANTS

    gpu.init()
    tp = gpu.symm()
    errs = {}
    for kind, variants in VARIANTS.items():
        for variant in variants:
            plan = _plan(kind, variant, world)
            for dtype in DTYPES:
                for rows in (ROWS, ROWS // 2, ROWS * 2):  # token counts change between calls
                    x, w, g, ref = _layer_case(rank, world, kind, variant, dtype, rows)
                    got = _run_layer(kind, x, w, g, plan, tp)
                    tol = gpu.TOL[x.dtype]
                    for key in ref:
                        errs[(kind, variant, dtype, rows, key)] = (gpu.rel(got[key], ref[key]), tol)
    tp.check()
    return errs, dict(tp.pass_bytes)


@pytest.mark.parametrize("world", [2, 4, 8])
def test_layer_passes_match_reference(world):
    for errs, pass_bytes in dist.run(_layers, world, env=gpu.ENV, timeout=400):
        bad = {k: v for k, v in errs.items() if not v[0] <= v[1]}
        assert not bad, bad
        assert pass_bytes.get("qkv_fprop", 0) > 0 and pass_bytes.get("proj_fprop", 0) > 0


def _growth(rank, world):
    """A column layer (rs_dgrad pipeline) at 32 tokens a rank; then a pass that grows the
    heap twice (64 MiB, then 128); the next pass releases what it outgrew, and the device
    gets that memory back (both ranks share the GPU: twice the bytes); then the layer at
    8192 tokens a rank, four times: every call equals the reference."""
    import torch
    import torch.distributed as tdist

    from megatron_overlap.comm.heap import MIN_GROWTH

    gpu.init()
    tp = gpu.symm()
    plan = _plan("column", "rs_dgrad_pipeline4", world)
    errs = []

    def call(rows):
        x, w, g, ref = _layer_case(rank, world, "column", "rs_dgrad_pipeline4", "float32", rows)
        got = _run_layer("column", x, w, g, plan, tp)
        errs.append(max(gpu.rel(got[k], ref[k]) for k in ref))

    def free_now():
        torch.cuda.synchronize()
        tdist.barrier()
        return torch.cuda.mem_get_info()[0]

    call(ROWS)
    tp.begin_pass("grow")
    for _ in range(2):
        tp.workspace((64 << 20,), torch.uint8)
    outgrown = sum(b.local.numel() for b in tp._bufs[:-1])
    before = free_now()
    tp.begin_pass("release")
    after = free_now()
    for _ in range(4):
        call(256 * ROWS)
    tp.begin_pass("after")
    torch.cuda.synchronize()
    tp.check()
    need = max(tp.pass_bytes.values())
    return (errs, outgrown, after - before, len(tp._bufs), tp.bytes_held, need,
            need + max(need / 8, MIN_GROWTH))


@pytest.mark.alone  # the device's free memory: other tests running beside would move it
def test_growth_gives_back_what_was_outgrown():
    import torch

    for errs, outgrown, freed, allocations, held, need, bound in dist.run(
            _growth, 2, env=gpu.ENV, timeout=200):
        assert max(errs) <= gpu.TOL[torch.float32], errs
        assert outgrown > 0 and freed >= 2 * outgrown * 0.9, (outgrown, freed)
        assert allocations == 1 and need <= held < bound, (allocations, held, need)


def _back_to_back(rank, world, iters):
    import torch

    gpu.init()
    tp = gpu.symm()
    cases = [(kind, variant, _plan(kind, variant, world), *_layer_case(rank, world, kind, variant, "bfloat16"))
             for kind, variant in (("column", "ring_aggregate"), ("column", "rs_dgrad_pipeline4"),
                                   ("row", "pipeline4"), ("row", "ring"))]
    first = {c[1]: _run_layer(c[0], *c[3:6], c[2], tp) for c in cases}
    for _ in range(iters):  # no host synchronisation in between
        last = {c[1]: _run_layer(c[0], *c[3:6], c[2], tp) for c in cases}
    torch.cuda.synchronize()
    tp.check()
    return {v: max((last[v][k] - first[v][k]).abs().max().item() for k in first[v]) for v in first}


def test_hundred_back_to_back_iterations():
    for diffs in dist.run(_back_to_back, 4, 100, env=gpu.ENV, timeout=400):
        assert diffs and all(d == 0.0 for d in diffs.values()), diffs


def _graphed(rank, world):
    import torch

    gpu.init()
    tp = gpu.symm()
    errs = {}
    for kind, variant in (("column", "ring_aggregate"), ("column", "rs_dgrad_ring"),
                          ("row", "pipeline2"), ("row", "ring_dgrad_aggregate")):
        plan = _plan(kind, variant, world)
        x, w, g, _ = _layer_case(rank, world, kind, variant, "bfloat16", seed=0)
        x2, _, g2, _ = _layer_case(rank, world, kind, variant, "bfloat16", seed=10)
        sx, sw, sg = x.clone(), w.clone().requires_grad_(), g.clone()
        sx.requires_grad_()
        from megatron_overlap.layers.functions import ColumnParallelMatmul, RowParallelMatmul

        def step():
            if kind == "column":
                y = ColumnParallelMatmul.apply(sx, sw, None, plan, tp, False, False)
            else:
                y = RowParallelMatmul.apply(sx, sw, None, plan, tp, False)
            y.backward(sg)
            return y

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: workspaces sized, kernels chosen
            for _ in range(3):
                step()
                sx.grad = sw.grad = None
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = step()
        for xi, gi in ((x, g), (x2, g2)):
            sx.data.copy_(xi)
            sg.copy_(gi)
            graph.replay()
            eager = _run_layer(kind, xi, w, gi, plan, tp)
            for key, val in (("y", y), ("dx", sx.grad), ("dw", sw.grad)):
                errs[(kind, variant, key, xi is x2)] = (val - eager[key]).abs().max().item()
    torch.cuda.synchronize()
    tp.check()
    return errs


def test_cuda_graph_replay_matches_eager():
    for errs in dist.run(_graphed, 2, env=gpu.ENV, timeout=300):
        assert errs and all(e == 0.0 for e in errs.values()), errs


def test_silent_peer_is_a_diagnosed_timeout():
    # several hardware queues: the watchdog's release reaches the stuck stream
    env = {**gpu.ENV, "CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    message = dist.run(gpu.silent_peer, 2, env=env, timeout=60)[0]
    assert message is not None
    assert "rank 0/2 waited for 'fc1_fprop' chunk 1 from rank 1" in message
    assert "MEGATRON_OVERLAP_TIMEOUT_S=3s" in message


def test_silent_peer_with_one_hardware_queue_is_not_a_hang():
    """Megatron's CUDA_DEVICE_MAX_CONNECTIONS=1: no release can reach the stuck
    stream; the device-side timeout traps (a CUDA error, then the diagnosis from
    check()), or, last resort, the watchdog ends the process with code 124."""
    try:
        message = dist.run(gpu.silent_peer, 2, env=gpu.ENV, timeout=60)[0]
    except RuntimeError as exc:
        assert "codes [124]" in str(exc)
    else:
        assert "rank 0/2 waited for 'fc1_fprop' chunk 1 from rank 1" in message
