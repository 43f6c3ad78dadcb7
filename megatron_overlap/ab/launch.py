"""Starting the ranks of an A/B run or benchmark, the same way on every machine.

- `gpus`: at least as many GPUs as ranks: one rank per GPU, NCCL. The real thing.
- `shared_gpu`: fewer GPUs than ranks: ranks share GPUs over a gloo group with
  TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1 (NCCL refuses two ranks on one GPU).
  Everything runs, but the ranks time-slice one chip: numbers are functional only.
- `cpu`: no GPU (or `device="cpu"`): gloo on CPU tensors.

NVLink multicast stays off on every machine (it can take a host's GPUs out of
service): the env below is set before any rank touches CUDA or NCCL.
"""

from __future__ import annotations

import datetime
import os
import socket
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

SAFE_ENV = {"TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NCCL_NVLS_ENABLE": "0",
            "NVSHMEM_DISABLE_NVLS": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
SHARED_ENV = {"TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES": "1"}
MODES = ("gpus", "shared_gpu", "cpu")


@dataclass(frozen=True)
class Layout:
    mode: str  # one of MODES
    world: int
    gpus: int  # visible GPUs

    @property
    def dist_backend(self) -> str:
        return "nccl" if self.mode == "gpus" else "gloo"

    @property
    def functional_only(self) -> bool:
        """Whether timings mean nothing for a multi-GPU machine (shared GPU or CPU)."""
        return self.mode != "gpus"

    @property
    def note(self) -> str:
        return {
            "gpus": f"{self.world} ranks, one per GPU, NCCL",
            "shared_gpu": (f"{self.world} ranks sharing {self.gpus} GPU(s) over gloo + symmetric "
                           f"memory: FUNCTIONAL ONLY, the ranks time-slice one chip and the "
                           f"baseline's collectives run through gloo; timings say nothing about "
                           f"multi-GPU overlap"),
            "cpu": (f"{self.world} CPU ranks over gloo: FUNCTIONAL ONLY (CPU GEMMs and gloo "
                    f"transfers; no GPU figure can be read from it)"),
        }[self.mode]

    def device(self, rank: int) -> torch.device:
        if self.mode == "cpu":
            return torch.device("cpu")
        local = int(os.environ.get("LOCAL_RANK", rank))
        return torch.device("cuda", local % self.gpus)


def plan_layout(world: int, device: str = "auto") -> Layout:
    """Pick the mode from the GPUs present. `device`: auto | cpu | cuda."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, not {device!r}")
    gpus = torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 0
    if device == "cuda" and gpus == 0:
        raise SystemExit("--device cuda: no CUDA GPU is visible")
    if gpus == 0:
        return Layout("cpu", world, 0)
    return Layout("gpus" if gpus >= world else "shared_gpu", world, gpus)


def default_world(tp: int | None, device: str = "auto") -> int:
    """--tp, else torchrun's WORLD_SIZE, else the GPU count when several, else 2."""
    if tp:
        return tp
    if "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    gpus = torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 0
    return gpus if gpus > 1 else 2


def rank_env(layout: Layout) -> dict[str, str]:
    """What every rank's environment must hold before CUDA / NCCL start (user values win)."""
    env = dict(SAFE_ENV)
    if layout.mode == "shared_gpu":
        env.update(SHARED_ENV)
    return {k: os.environ.get(k, v) for k, v in env.items()}


def init_dist(layout: Layout, rank: int, timeout_s: float = 600) -> torch.device:
    """The process group for this layout (env:// rendezvous) and this rank's device."""
    os.environ.update(rank_env(layout))
    device = layout.device(rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    elif "OMP_NUM_THREADS" not in os.environ:  # ranks oversubscribing the cores time nothing
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // layout.world))
    if not dist.is_initialized():
        dist.init_process_group(layout.dist_backend, rank=rank, world_size=layout.world,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return device


def barrier(device: torch.device) -> None:
    """All ranks here; on a GPU, with this rank's queued work finished first."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[device.index])
            return
    dist.barrier()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def emulate_nodes(gpus_per_node: int, world: int, device: str = "auto") -> dict[str, str]:
    """Make the ranks see nodes of `gpus_per_node` (topology reads LOCAL_WORLD_SIZE),
    so a TP group of `world` spans world / gpus_per_node of them on one host. On GPUs,
    NCCL is kept off NVLink and shared memory (sockets over loopback), the way its
    traffic between real nodes leaves the NVLink domain; NCCL reads these once per
    process, so the baseline's collectives go that way too. Returns what was set."""
    if gpus_per_node < 1 or world % gpus_per_node:
        raise SystemExit(f"--gpus-per-node {gpus_per_node} must divide the {world} ranks")
    env = {"LOCAL_WORLD_SIZE": str(gpus_per_node)}
    if plan_layout(world, device).mode == "gpus":
        env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", NCCL_NET="Socket",
                   NCCL_SOCKET_IFNAME=os.environ.get("NCCL_SOCKET_IFNAME", "lo"))
    os.environ.update(env)
    return env


def _entry(rank: int, world: int, port: int, env: dict[str, str], fn: Callable, args: tuple) -> None:
    os.environ.update(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    fn(rank, world, *args)


def launch(fn: Callable[..., Any], world: int, *args: Any, device: str = "auto") -> None:
    """Run fn(rank, world, *args) on every rank: in this process when started by
    torchrun (RANK set; WORLD_SIZE must equal `world`), else on `world` spawned
    processes. A rank that raises makes this raise."""
    env = rank_env(plan_layout(world, device))
    if "RANK" in os.environ:
        if int(os.environ["WORLD_SIZE"]) != world:
            raise SystemExit(f"torchrun started {os.environ['WORLD_SIZE']} ranks but TP is {world}: "
                             f"pass --tp {os.environ['WORLD_SIZE']} or --nproc-per-node {world}")
        os.environ.update(env)
        fn(int(os.environ["RANK"]), world, *args)
        return
    os.environ.update(env)  # before the children start: they inherit it
    torch.multiprocessing.spawn(_entry, args=(world, _free_port(), env, fn, args), nprocs=world,
                                join=True)
