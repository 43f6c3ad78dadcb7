"""The ring all-gather's one waiting GEMM (`overlap.wait_gemm`, the `wait_gemm` key) on
a GPU:

- the kernel against torch's GEMMs: bf16 with the weight either way round (a forward's
  and a dgrad's), FP8 e4m3 x e4m3 and e5m2 x e4m3 (hybrid's dgrad) with per-tensor scales,
  blocks in a ring's arrival order;
- it waits: blocks written late from another stream, each flagged after its bytes, give
  the product of the late bytes, not of what the buffer held before;
- a flag never set traps once the timeout has passed (a CUDA error, not a hang);
- the ring on MirrorTransport replayed from a CUDA graph;
- on `symm` with 2 and 4 ranks sharing the GPU (one hardware queue, as Megatron runs):
  bf16 and FP8, plain and aggregate rings, against the whole product, eagerly and replayed;
  a peer that never sends is the transport's diagnosed timeout.
"""

import subprocess
import sys
import textwrap

import pytest
import torch

from helpers import dist, gpu

ROWS, K, N = 128, 256, 512


def _quantized(t: torch.Tensor, dtype: torch.dtype):
    from megatron_overlap.layers.fp8 import quantized

    q, s, _ = quantized(t, dtype)
    return q, s


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def _launch(a, wt, out, ready, order, gemm, timeout_s=30.0, descriptors=True):
    from megatron_overlap.overlap import wait_gemm

    assert wait_gemm.why_not(a[:ROWS], wt, gemm, "", ROWS) is None
    if descriptors:  # TMA where the GPU has it (every Hopper): else this would test the other
        assert wait_gemm.tma(a, wt, out) == (torch.cuda.get_device_capability()[0] >= 9)
    wait_gemm.launch(a, wt, out, ready, order, ROWS, gemm, op="test", timeout_s=timeout_s,
                     descriptors=descriptors)


KERNELS = pytest.mark.parametrize("descriptors", [True, False], ids=["tma", "pointers"])


@KERNELS
@pytest.mark.parametrize("case", ["bf16_fprop", "bf16_dgrad", "e4m3", "e4m3_fast", "e5m2_e4m3"])
def test_the_kernel_equals_torchs_gemm(case, descriptors):
    from megatron_overlap.overlap.fp8 import ScaledGemm
    from megatron_overlap.overlap.gemm import matmul

    world = 4
    g = torch.Generator().manual_seed(0)
    a = torch.randn(world * ROWS, K, generator=g).cuda()
    w = (torch.randn(N, K, generator=g) / K ** 0.5).cuda()
    ready = torch.ones(world, dtype=torch.int32, device="cuda")
    order = torch.tensor([2, 1, 0, 3], dtype=torch.int32, device="cuda")  # rank 2's ring
    if case.startswith("bf16"):
        a, w = a.bfloat16(), w.bfloat16()
        # a forward's weight [N, K] as wt = w.t() (K-major); a dgrad's [K, N] row-major
        wt = w.t() if case == "bf16_fprop" else w.t().contiguous()
        want, gemm = a @ wt, matmul
    else:
        a_dtype = torch.float8_e4m3fn if case.startswith("e4m3") else torch.float8_e5m2
        (aq, sa), (wq, sw) = _quantized(a, a_dtype), _quantized(w, torch.float8_e4m3fn)
        # e4m3_fast: a forward's accumulation (install()'s default), the tiles never promoted;
        # the others promote to fp32 every BLOCK_K, as cuBLAS without fast accumulation
        gemm = ScaledGemm(sa, sw, torch.bfloat16, fast_accum=case.endswith("_fast"))
        a, wt = aq, wq.t()
        want = gemm(a, wt, op="want")
    out = torch.full((world * ROWS, N), float("nan"), dtype=want.dtype, device="cuda")
    _launch(a, wt, out, ready, order, gemm, descriptors=descriptors)
    torch.cuda.synchronize()
    assert _rel(out, want) < 1e-2, case  # (tile order against cuBLAS's; FP8 per-tensor scales)


@KERNELS
def test_it_waits_for_blocks_written_late(descriptors):
    from megatron_overlap.overlap import wait_gemm
    from megatron_overlap.overlap.gemm import matmul

    world = 4
    g = torch.Generator().manual_seed(1)
    a = torch.randn(world * ROWS, K, generator=g).cuda().bfloat16()
    w = (torch.randn(N, K, generator=g) / K ** 0.5).cuda().bfloat16()
    late = a.clone()
    a[ROWS:].fill_(float("nan"))  # what the buffer holds before the blocks land
    ready = torch.zeros(world, dtype=torch.int32, device="cuda")
    ready[0] = 1
    order = torch.arange(world, dtype=torch.int32, device="cuda")
    out = torch.empty(world * ROWS, N, dtype=torch.bfloat16, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # queued before the GEMM, as the schedule does (FlagSide)
        for b in range(1, world):
            torch.cuda._sleep(2_000_000)  # ~1 ms: the GEMM is spinning on block b by now
            a[b * ROWS:(b + 1) * ROWS].copy_(late[b * ROWS:(b + 1) * ROWS])
            wait_gemm.set_flag(ready, b)
    _launch(a, w.t(), out, ready, order, matmul, descriptors=descriptors)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert _rel(out, late @ w.t()) < 1e-2


def test_a_flag_never_set_traps_after_the_timeout():
    """In a process of its own: a trap leaves the CUDA context unusable."""
    code = textwrap.dedent(f"""
        import time, torch
        from megatron_overlap.overlap import wait_gemm
        from megatron_overlap.overlap.gemm import matmul
        a = torch.randn(2 * {ROWS}, {K}, device="cuda", dtype=torch.bfloat16)
        w = torch.randn({K}, {N}, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(2 * {ROWS}, {N}, device="cuda", dtype=torch.bfloat16)
        ready = torch.tensor([1, 0], dtype=torch.int32, device="cuda")
        order = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
        t0 = time.time()
        try:
            wait_gemm.launch(a, w, out, ready, order, {ROWS}, matmul, op="t", timeout_s=1.0)
            torch.cuda.synchronize()
        except RuntimeError as e:
            print("ERROR after %.1f s: %s" % (time.time() - t0, str(e).splitlines()[0]))
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "ERROR after" in done.stdout, (done.stdout, done.stderr[-2000:])
    assert float(done.stdout.split("ERROR after ")[1].split(" s")[0]) < 10, done.stdout


def test_the_ring_replays_from_a_graph():
    from megatron_overlap.ab.emulated_tp import MirrorTransport
    from megatron_overlap.ab.timing import graphed
    from megatron_overlap.overlap.ag_gemm import all_gather_matmul

    world, rank = 8, 7
    tp = MirrorTransport(world, rank)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(ROWS, K, generator=g).cuda().bfloat16()
    w = (torch.randn(N, K, generator=g) / K ** 0.5).cuda().bfloat16()

    def run():
        tp.begin_pass("ring")
        return all_gather_matmul(x, w, tp, "ring_exchange", op="ring", wait=True)[0]
    replay, out = graphed(run, warmup=1)
    for i in range(3):
        x.copy_(torch.randn(ROWS, K, generator=g).cuda().bfloat16())
        replay()
        torch.cuda.synchronize()
        assert _rel(out, (x @ w.t()).repeat(world, 1)) < 1e-2, f"replay {i}"


def _symm_rings(rank, world):
    from megatron_overlap.overlap import all_gather_matmul
    from megatron_overlap.overlap.fp8 import ScaledGemm

    gpu.init()
    tp = gpu.symm()
    blk = slice(rank * ROWS, (rank + 1) * ROWS)
    errs = {}
    x_full, w = gpu.full(1, world * ROWS, K), gpu.full(2, N, K) / K ** 0.5
    (xq, sx), (wq, sw) = _quantized(x_full, torch.float8_e4m3fn), _quantized(w, torch.float8_e4m3fn)
    gemm8 = ScaledGemm(sx, sw, torch.bfloat16, fast_accum=False)
    cases = {"bf16": (x_full.bfloat16(), w.bfloat16(), None), "fp8": (xq, wq, gemm8)}
    for name, (xf, wf, gemm) in cases.items():
        kw = {} if gemm is None else {"gemm": gemm}
        want = (xf @ wf.t()) if gemm is None else gemm8(xq, wq.t(), op="want")
        for aggregate in ((False, True) if world > 2 else (False,)):
            tp.begin_pass("ag")
            y, gathered = all_gather_matmul(xf[blk], wf, tp, "ring_exchange", op="ag",
                                            aggregate=aggregate, wait=True, **kw)
            torch.cuda.synchronize()
            errs[(name, aggregate, "eager")] = max(_rel(y, want), float(not torch.equal(
                gathered.view(torch.uint8), xf.view(torch.uint8))))
        x_in = xf[blk].clone()
        out = torch.empty_like(want)

        def step():
            tp.begin_pass("ag_graph")
            all_gather_matmul(x_in, wf, tp, "ring_exchange", op="ag_graph", out=out, wait=True, **kw)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        errs[(name, "graph")] = _rel(out, want)
    tp.check()
    return errs


@pytest.mark.parametrize("world", [2, 4])
def test_symm_ranks_sharing_the_gpu(world):
    for errs in dist.run(_symm_rings, world, env=gpu.ENV, timeout=300):
        assert errs and all(e < 1e-2 for e in errs.values()), errs


def test_a_silent_peer_is_the_transports_diagnosed_timeout():
    env = {**gpu.ENV, "CUDA_DEVICE_MAX_CONNECTIONS": "8"}
    message = dist.run(gpu.silent_peer, 2, True, env=env, timeout=60)[0]
    assert message is not None and "rank 0/2 waited for 'fc1_fprop' chunk 1 from rank 1" in message
