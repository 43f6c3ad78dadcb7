"""The `nvshmem` transport with one PE on one GPU (NVSHMEM refuses its
point-to-point waits with several processes on one GPU: "not supported with
limited MPG runs"; more PEs need more GPUs, issue 7). One PE still runs every
piece of the transport for real: bootstrap over a torch process group, symmetric
allocations and their growth, put-with-signal into the heap (to itself), staging
of sources outside the heap, sequence-numbered signal slots reset per pass behind
NVSHMEM's on-stream barrier, CUDA-graph capture, and the watchdog's diagnosis of a
wait that nobody answers."""

import pytest

from helpers import dist, gpu

ENV = {"NVSHMEM_DISABLE_NVLS": "1", "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo"}
nvshmem4py = pytest.importorskip(
    "nvshmem.core", reason="nvshmem4py is not installed (a CUDA-only wheel; the GPU session "
                           "carries it: benchmarks/gpu_session.sh)")


def _transport(timeout_s=None):
    import datetime

    import torch
    import torch.distributed as tdist

    from megatron_overlap.comm import transport_for
    from megatron_overlap.comm.nvshmem import NvshmemTransport

    gpu.init()
    if timeout_s is not None:
        return NvshmemTransport(tdist.group.WORLD, torch.device("cuda", torch.cuda.current_device()),
                                timeout=datetime.timedelta(seconds=timeout_s))
    return transport_for(tdist.group.WORLD, "nvshmem", torch.device("cuda", torch.cuda.current_device()))


def _passes(rank, world):
    import torch

    from megatron_overlap.comm import CommError
    from megatron_overlap.comm.nvshmem import MAX_SEQ

    tp = _transport()
    out = {"errs": [], "held": []}
    for step, rows in enumerate((64, 4096, 64)):  # grows once, then reuses
        tp.begin_pass(f"fc1_fprop@{rows}")
        xs = [gpu.full(100 * step + i, rows, 96) for i in range(4)]
        dsts = [tp.workspace(x.shape, x.dtype) for x in xs]
        heap_src = tp.workspace(xs[0].shape, xs[0].dtype)
        heap_src.copy_(xs[0] * 2)
        heap_dst = tp.workspace(xs[0].shape, xs[0].dtype)
        handles = [tp.exchange([(x, 0, d)], [(d, 0)], op="fc1_fprop", chunk=i)
                   for i, (x, d) in enumerate(zip(xs, dsts))]
        handles.append(tp.exchange([(heap_src, 0, heap_dst)], [(heap_dst, 0)], op="fc1_fprop", chunk=9))
        for h in handles:
            h.wait()
        gathered, red, allred = torch.empty_like(xs[1]), torch.empty_like(xs[2]), xs[3].clone()
        for h in (tp.all_gather(gathered, xs[1], op="ag"), tp.reduce_scatter(red, xs[2], op="rs"),
                  tp.all_reduce(allred, op="ar")):
            h.wait()
        got = dsts + [heap_dst, gathered, red, allred]
        want = xs + [xs[0] * 2, xs[1], xs[2], xs[3]]
        out["errs"].append(max((a - b).abs().max().item() for a, b in zip(got, want)))
        out["held"].append(tp.bytes_held)
    tp.begin_pass("overflow")
    d = tp.workspace((4,), torch.float32)
    try:
        for i in range(MAX_SEQ + 1):
            tp.exchange([(d, 0, d)], [(d, 0)], op="overflow", chunk=i).wait()
    except CommError as exc:
        out["overflow"] = str(exc)
    torch.cuda.synchronize()
    out["describe"] = tp.describe()
    # teardown: uninstall's comm.reset() closes it: memory freed, the NVSHMEM job ended
    import nvshmem.bindings as nb

    from megatron_overlap import comm
    from megatron_overlap.comm import nvshmem as nvshmem_transport

    comm.reset()
    out["closed"] = (tp.bytes_held, dict(nvshmem_transport._runtime),
                     nb.init_status() == nb.Init_status.STATUS_IS_INITIALIZED)
    return out


def test_self_puts_collectives_and_growth():
    r = dist.run(_passes, 1, env=ENV, timeout=180)[0]
    assert r["errs"] == [0.0, 0.0, 0.0]
    assert r["held"][0] < r["held"][1] == r["held"][2]  # grew for 4096 rows, then reused
    assert "more than 256 transfers with rank 0 in one layer pass" in r["overflow"]
    assert r["describe"]["transport"] == "nvshmem" and r["describe"]["pes"] == 1
    held, runtime, still_initialized = r["closed"]
    assert held == 0 and runtime == {} and not still_initialized


def _graphed(rank, world):
    import torch

    tp = _transport()
    w = gpu.full(1, 48, 96)
    static_x = gpu.full(2, 128, 96)

    def step():
        tp.begin_pass("graphed")
        dst = tp.workspace(static_x.shape, static_x.dtype)
        tp.exchange([(static_x, 0, dst)], [(dst, 0)], op="graphed", chunk=1).wait()
        return dst @ w.t()

    step()  # sizes the heap eagerly before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    errs = []
    for seed in (3, 4, 5):
        x = gpu.full(seed, 128, 96)
        static_x.copy_(x)
        graph.replay()
        errs.append((out - x @ w.t()).abs().max().item())
    torch.cuda.synchronize()
    return errs


def test_cuda_graph_replay_matches_eager():
    assert dist.run(_graphed, 1, env=ENV, timeout=180)[0] == [0.0, 0.0, 0.0]


def _unanswered(rank, world):
    import torch

    from megatron_overlap.comm import CommError

    tp = _transport(timeout_s=2)
    tp.begin_pass("fc1_fprop")
    d = tp.workspace((16,), torch.float32)
    tp.exchange([], [(d, 0)], op="fc1_fprop", chunk=1).wait()  # nobody sends
    torch.cuda.synchronize()  # returns once the watchdog released the wait
    try:
        tp.check()
    except CommError as exc:
        return str(exc)
    return None


def test_unanswered_wait_is_diagnosed_not_a_hang():
    # several hardware queues: the watchdog's release reaches the stuck stream
    message = dist.run(_unanswered, 1, env={**ENV, "CUDA_DEVICE_MAX_CONNECTIONS": "8"},
                       timeout=120)[0]
    assert "rank 0/1 waited for 'fc1_fprop' chunk 1 from rank 0" in message
    assert "MEGATRON_OVERLAP_TIMEOUT_S=2s" in message


def test_unanswered_wait_with_one_hardware_queue_ends_the_process():
    """Megatron's CUDA_DEVICE_MAX_CONNECTIONS=1 queues the watchdog's release behind
    the stuck wait: the process ends (code 124) with the diagnosis instead."""
    env = {**ENV, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    try:
        message = dist.run(_unanswered, 1, env=env, timeout=120)[0]
    except RuntimeError as exc:
        assert "codes [124]" in str(exc)
    else:  # the release got through after all: then it must be the diagnosed error
        assert "rank 0/1 waited for 'fc1_fprop' chunk 1 from rank 0" in message
