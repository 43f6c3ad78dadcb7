"""What nvshmem4py does on the GPU machine, step by step, with WORLD processes on the
visible GPUs (several may share one): bootstrap from a torch (gloo) process group
through a unique id (no MPI), a symmetric allocation seen as a torch tensor, raw
pointer put-with-signal and signal-wait on torch streams, NVSHMEM's on-stream
barrier, CUDA-graph capture of a put + wait, finalize. Prints one line per step.

    python benchmarks/probe_nvshmem.py 1     # one PE
    python benchmarks/probe_nvshmem.py 2     # two PEs (on one GPU: "MPG" mode)
"""

import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def step(rank, name, fn):
    try:
        out = fn()
        print(f"[rank {rank}] OK   {name}{': ' + str(out) if out is not None else ''}", flush=True)
        return out
    except Exception as exc:  # report and go on: the point is to see what works
        print(f"[rank {rank}] FAIL {name}: {type(exc).__name__}: {exc}", flush=True)
        traceback.print_exc(limit=2)
        return None


def main(rank, world, port):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dev = rank % torch.cuda.device_count()
    torch.cuda.set_device(dev)
    import numpy as np
    import nvshmem.bindings as nb
    import nvshmem.core as nvshmem
    from cuda.core import Device

    uid = nvshmem.get_unique_id(empty=rank != 0)
    raw = [bytes(uid._data.view(np.int8).tobytes())]
    dist.broadcast_object_list(raw, src=0)
    if rank:
        uid._data.view(np.int8)[:] = np.frombuffer(raw[0], dtype=np.int8)
    device = Device(dev)
    device.set_current()
    if step(rank, "init(uid over gloo)", lambda: nvshmem.init(device=device, uid=uid, rank=rank,
                                                                nranks=world, initializer_method="uid")) is None \
            and nb.init_status() == 0:
        pass
    step(rank, "my_pe/n_pes", lambda: (nb.my_pe(), nb.n_pes()))
    buf = step(rank, "bytetensor(4 MiB)", lambda: nvshmem.interop.torch.bytetensor((4 << 20,)))
    sig = step(rank, "bytetensor(signals)", lambda: nvshmem.interop.torch.bytetensor((4096,)))
    if buf is None or sig is None:
        return
    sig.zero_()
    torch.cuda.synchronize()
    step(rank, "peer pointers nvshmem_ptr", lambda: [hex(nb.ptr(buf.data_ptr(), p)) for p in range(world)])
    stream = torch.cuda.Stream()
    peer = (rank + 1) % world
    src = torch.full((1 << 20,), float(rank + 1), device="cuda")
    dst = buf[: 4 << 20].view(torch.float32)
    slot = sig.view(torch.int64)
    s = stream.cuda_stream

    def put_and_wait():
        # put my block into the right neighbour's buffer; signal slot[rank] there
        nb.putmem_signal_on_stream(dst.data_ptr(), src.data_ptr(), src.numel() * 4,
                                   slot[rank:].data_ptr(), 1, nb.Signal_op.SIGNAL_SET, peer, s)
        left = (rank - 1) % world
        nb.signal_wait_until_on_stream(slot[left:].data_ptr(), nb.Cmp_type.CMP_EQ, 1, s)
        torch.cuda.current_stream().wait_stream(stream)

    with torch.cuda.stream(stream):
        step(rank, "putmem_signal + signal_wait on a torch stream", put_and_wait)
    torch.cuda.synchronize()
    step(rank, "received data right", lambda: float(dst[:4].sum()) == 4.0 * ((rank - 1) % world + 1))
    step(rank, "barrier_all_on_stream", lambda: nb.barrier_all_on_stream(s))
    torch.cuda.synchronize()
    slot.zero_()
    step(rank, "barrier_all_on_stream (2)", lambda: nb.barrier_all_on_stream(torch.cuda.current_stream().cuda_stream))
    torch.cuda.synchronize()

    def capture():
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            cs = torch.cuda.current_stream().cuda_stream
            nb.putmem_signal_on_stream(dst.data_ptr(), src.data_ptr(), src.numel() * 4,
                                       slot[rank:].data_ptr(), 1, nb.Signal_op.SIGNAL_SET, peer, cs)
            nb.signal_wait_until_on_stream(slot[(rank - 1) % world:].data_ptr(), nb.Cmp_type.CMP_EQ, 1, cs)
            slot.zero_()
            nb.barrier_all_on_stream(cs)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        return "3 replays"

    step(rank, "graph capture: put+signal, wait, reset, barrier", capture)
    step(rank, "quiet_on_stream", lambda: nb.quiet_on_stream(s))
    torch.cuda.synchronize()
    step(rank, "free + finalize", lambda: (nvshmem.free_tensor(buf), nvshmem.free_tensor(sig),
                                             nvshmem.finalize()))
    dist.destroy_process_group()


if __name__ == "__main__":
    world = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    import socket
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        port = so.getsockname()[1]
    mp.spawn(main, args=(world, port), nprocs=world, join=True)
