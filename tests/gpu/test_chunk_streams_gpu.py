"""Chunk GEMMs on several streams (`gemm_streams` > 1, `overlap.streams`) read what the
transfers wrote: on one GPU, one process playing rank 7 of 8 on `MirrorTransport`, the
ring all-gather's and the pipelined reduce-scatter's results against the plain math, for
1, 2, 3 and 8 streams (the most the tuner tries: one per chunk for the plain ring; the
aggregate ring's 5 GEMMs and the pipeline's 4 use as many), eagerly and replayed from a
CUDA graph.

A ring's wait runs on the stream of the GEMM that reads the block, not on the stream
that started the transfer; the handle must order that stream after the transfer. Each
call gets new inputs, so a GEMM that ran before its block was written reads the previous
call's block and gives the previous call's product. Eagerly the host is slower than the
copies, so the ring's eager cases delay each transfer on the GPU first (`_Late`): a GEMM
not ordered after it runs before it. (The pipelined reduce-scatter's copies run on the
GEMM's own stream: that test checks the results, not the ordering.)"""

import pytest
import torch

WORLD, RANK, ROWS, K, N = 8, 7, 1024, 4096, 2048


def _late_mirror():
    """MirrorTransport whose exchanges first keep the stream busy for a while."""
    from megatron_overlap.ab.emulated_tp import MirrorTransport

    class _Late(MirrorTransport):
        def _start_exchange(self, sends, recvs, op, chunk):
            torch.cuda._sleep(200_000)  # ~0.1 ms of the copying stream's time
            return super()._start_exchange(sends, recvs, op, chunk)
    return _Late(WORLD, RANK)


def _case(i: int):
    g = torch.Generator().manual_seed(100 + i)
    return (torch.randn(ROWS, K, generator=g).to("cuda", torch.bfloat16),
            (torch.randn(N, K, generator=g) / K ** 0.5).to("cuda", torch.bfloat16))


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got.float() - want.float()).abs().max().item() / want.float().abs().max().item()
    assert err < 2e-2, f"{what}: max |diff| / max |expected| = {err:.3g}"


@pytest.mark.parametrize("streams", [1, 2, 3, 8])
@pytest.mark.parametrize("aggregate", [False, True])
def test_ring_all_gather_chunks_on_streams_read_arrived_blocks(streams, aggregate):
    from megatron_overlap.overlap.ag_gemm import all_gather_matmul
    from megatron_overlap.overlap.streams import ChunkStreams

    tp = _late_mirror()
    for i in range(6):
        x, w = _case(i)
        tp.begin_pass("ring")
        out, gathered = all_gather_matmul(x, w, tp, "ring_exchange", op="ring", aggregate=aggregate,
                                          streams=ChunkStreams(n=streams))
        torch.cuda.synchronize()
        assert torch.equal(gathered, x.repeat(WORLD, 1)), f"call {i}: the gathered blocks"
        _close(out, (x @ w.t()).repeat(WORLD, 1), f"call {i}, {streams} streams")


@pytest.mark.parametrize("streams", [1, 2, 3, 8])
def test_ring_all_gather_on_streams_replays_from_a_graph(streams):
    from megatron_overlap.ab.emulated_tp import MirrorTransport
    from megatron_overlap.ab.timing import graphed
    from megatron_overlap.overlap.ag_gemm import all_gather_matmul
    from megatron_overlap.overlap.streams import ChunkStreams

    tp = MirrorTransport(WORLD, RANK)
    x, w = _case(0)

    def run():
        tp.begin_pass("ring")
        return all_gather_matmul(x, w, tp, "ring_exchange", op="ring",
                                 streams=ChunkStreams(n=streams))[0]
    replay, out = graphed(run, warmup=1)  # (the warm-up grows the workspace outside the capture)
    for i in range(1, 6):
        xi, wi = _case(i)
        x.copy_(xi)
        w.copy_(wi)
        replay()
        torch.cuda.synchronize()
        _close(out, (xi @ wi.t()).repeat(WORLD, 1), f"replay {i}, {streams} streams")


@pytest.mark.parametrize("streams", [1, 2, 3, 8])
def test_pipelined_reduce_scatter_chunks_on_streams(streams):
    from megatron_overlap.ab.emulated_tp import MirrorTransport
    from megatron_overlap.overlap.gemm_rs import matmul_reduce_scatter
    from megatron_overlap.overlap.streams import ChunkStreams

    tp = MirrorTransport(WORLD, RANK)
    for i in range(4):
        g = torch.Generator().manual_seed(200 + i)
        x = torch.randn(WORLD * 256, K, generator=g).to("cuda", torch.bfloat16)
        w = (torch.randn(N, K, generator=g) / K ** 0.5).to("cuda", torch.bfloat16)
        tp.begin_pass("pipeline")
        out = matmul_reduce_scatter(x, w, tp, "pipeline", 4, op="pipeline",
                                    streams=ChunkStreams(n=streams))
        torch.cuda.synchronize()
        # mirrored: every peer's partial of this rank's block is this rank's own
        want = (x[RANK * 256:(RANK + 1) * 256].float() @ w.float().t()) * WORLD
        _close(out, want, f"call {i}, {streams} streams")
