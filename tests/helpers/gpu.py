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
