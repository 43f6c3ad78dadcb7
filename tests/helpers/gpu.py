"""Ranks that share one GPU: gloo process group, CUDA tensors, the symm transport."""

from __future__ import annotations

import os

import torch

from megatron_overlap.ab.compare import rel_error

ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def init(per_gpu: bool | None = None) -> torch.device:
    """One rank per GPU over NCCL where there are enough GPUs (or `per_gpu=True`),
    else every rank on GPU 0 over gloo (torch symmetric memory lets them share it)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if per_gpu is None:
        per_gpu = torch.cuda.device_count() >= world
    device = torch.device("cuda", rank if per_gpu else 0)
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if per_gpu else "gloo", rank=rank, world_size=world,
                                device_id=device if per_gpu else None)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return device


def transport(backend: str = "symm", timeout_s: float | None = None):
    """The TP transport of the whole world group, on this rank's GPU."""
    import datetime

    import torch.distributed as dist

    t = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    device = torch.device("cuda", torch.cuda.current_device())
    if backend == "symm":
        from megatron_overlap.comm.symm import SymmTransport
        return SymmTransport(dist.group.WORLD, device, timeout=t)
    if backend == "nvshmem":
        from megatron_overlap.comm.nvshmem import NvshmemTransport
        return NvshmemTransport(dist.group.WORLD, device, timeout=t)
    from megatron_overlap.comm.torch_p2p import TorchP2PTransport
    return TorchP2PTransport(dist.group.WORLD, timeout=t)


def symm(timeout_s: float | None = None):
    return transport("symm", timeout_s)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return rel_error(a, b, dtype=torch.float32)


def full(seed: int, *shape: int) -> torch.Tensor:
    """The same tensor on every rank (fp32, on the GPU)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).cuda()


def silent_peer(rank: int, world: int, wait: bool = False):
    """A ring all-gather ('fc1_fprop') on `symm` with a 3 s timeout that rank 1 never joins:
    rank 0's CommError message from check() (None on rank 1). `wait`: the ring's one
    waiting GEMM (`wait_gemm`; bf16, which it takes), else the chunk GEMMs (fp32)."""
    import torch.distributed as tdist

    from megatron_overlap.comm import CommError
    from megatron_overlap.overlap import all_gather_matmul

    from megatron_overlap.overlap import wait_gemm

    init()
    tp = symm(timeout_s=3)
    # the waiting GEMM's operands come in whole tiles (128 rows, N in 256s, K in 64s)
    dtype, (rows, k, n) = (torch.bfloat16, (128, 256, 512)) if wait else (torch.float32, (32, 64, 48))
    x, w = full(1, rows, k).to(dtype), full(2, n, k).to(dtype)
    assert not wait or wait_gemm.why_not(x, w.t(), wait_gemm.matmul, tp.why_no_wait, rows) is None
    x @ w.t()  # cuBLAS set up now: its first call blocks, GIL held, behind a stuck stream
    tp.begin_pass("fc1_fprop")
    message = None
    if rank == 0:
        try:
            all_gather_matmul(x, w, tp, "ring_exchange", op="fc1_fprop", wait=wait)
            # Returns once the watchdog released the stuck wait; with one hardware queue
            # (CUDA_DEVICE_MAX_CONNECTIONS=1) the release is stuck too and the device-side
            # timeout traps instead: a CUDA error, never a hang.
            torch.cuda.synchronize()
        except RuntimeError:
            pass
        try:
            tp.check()
        except CommError as exc:
            message = str(exc)
    tdist.barrier()  # rank 1 never signalled; both leave together (over gloo, on the CPU)
    return message
