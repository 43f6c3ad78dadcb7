"""Ranks that share one GPU: gloo process group, CUDA tensors, the symm transport."""

from __future__ import annotations

import os

import torch

ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def init() -> torch.device:
    import torch.distributed as dist

    torch.cuda.set_device(0)
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    return torch.device("cuda", 0)


def symm(timeout_s: float | None = None):
    import datetime

    import torch.distributed as dist

    from megatron_overlap.comm.symm import SymmTransport

    t = datetime.timedelta(seconds=timeout_s) if timeout_s else None
    return SymmTransport(dist.group.WORLD, torch.device("cuda", 0), timeout=t)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def full(seed: int, *shape: int) -> torch.Tensor:
    """The same tensor on every rank (fp32, on the GPU)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).cuda()
