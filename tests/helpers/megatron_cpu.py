"""Megatron-core on CPU with gloo, for tests only. Megatron assumes CUDA in a few
places that matter here: `torch.cuda.current_device()` for buffers (its global
memory buffer, the reduce-scatter output), `torch.cuda.synchronize`,
`torch.cuda.current_stream()` (DDP's grad sync, megatron-core 0.19), the CUDA
RNG tracker, and the loss-scale tensor its optimizers make on 'cuda'
(`cuda_tensors_on_cpu`). The shims point them at the CPU; they never enter the
library."""

from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode


class _NoStream:
    """Stands in for torch.cuda.current_stream(): on CPU every op is already ordered."""

    def wait_event(self, *_):
        pass

    def wait_stream(self, *_):
        pass

    def synchronize(self):
        pass


def install_cpu_shims() -> None:
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    torch.cuda.current_stream = lambda *a, **k: _NoStream()  # type: ignore[assignment]
    torch.cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    torch.cuda.device_count = lambda: 0  # type: ignore[assignment]
    from megatron.core.tensor_parallel import random as mrandom

    class _CPURNGTracker(mrandom.CudaRNGStatesTracker):
        """Megatron's tracker with torch's CPU generator standing in for CUDA's."""

        def add(self, name, seed):
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()
            self.seeds_.add(seed)

        def fork(self, name="model-parallel-rng"):
            import contextlib

            @contextlib.contextmanager
            def _fork():
                saved = torch.get_rng_state()
                torch.set_rng_state(self.states_[name])
                try:
                    yield
                finally:
                    self.states_[name] = torch.get_rng_state()
                    torch.set_rng_state(saved)
            return _fork()

    mrandom._CUDA_RNG_STATE_TRACKER = _CPURNGTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


class _CudaToCpu(TorchFunctionMode):
    """Tensors created with device='cuda' are made on the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_tensors_on_cpu() -> Iterator[None]:
    """Inside: `torch.tensor(..., device='cuda')` and the like make CPU tensors (Megatron's
    optimizers make their loss-scale tensors on 'cuda' at construction)."""
    with _CudaToCpu():
        yield


def rng_states_on_cpu() -> None:
    """Megatron's activation checkpointing saves and restores the CUDA generator's state
    beside the CPU's and the tracker's; on CPU there is no CUDA generator (the CPU one and
    the CPU tracker above carry every random draw), so that part is skipped."""
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: None
    mrandom._set_cuda_rng_state = lambda *a, **k: None


def init(tp: int, seed: int = 1234) -> None:
    """gloo process group (env:// from helpers.dist) + Megatron's TP groups."""
    install_cpu_shims()
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=int(os.environ["RANK"]),
                                world_size=int(os.environ["WORLD_SIZE"]))
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    torch.manual_seed(seed)
    mrandom.get_cuda_rng_tracker().add("model-parallel-rng", seed + 2718)
