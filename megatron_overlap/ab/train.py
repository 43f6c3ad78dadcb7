"""One arm of an A/B run: a Megatron DDP-wrapped model stepped with Megatron's
gradient finalisation, timed per step."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch


@dataclass
class StepResult:
    step: int
    loss: float
    step_time_s: float


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TrainArm:
    """`forward(model, batch) -> loss tensor`; the optimizer steps on what
    `finalize_model_grads` leaves in each parameter's `main_grad`."""

    def __init__(self, name: str, ddp_model: torch.nn.Module,
                 forward: Callable[[torch.nn.Module, object], torch.Tensor],
                 optimizer: Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]):
        self.name, self.model, self.forward = name, ddp_model, forward
        self.params = [p for p in ddp_model.parameters() if p.requires_grad]
        self.optimizer = optimizer(self.params)
        self.device = self.params[0].device
        self.results: list[StepResult] = []
        _identity_grad_sync_on_gloo_cuda(ddp_model, self.device)

    def gradients(self, batch: object) -> torch.Tensor:
        """Forward and backward on `batch` into fresh grad buffers, finalised as Megatron's
        training does (each parameter's `main_grad`); returns the loss."""
        from megatron.core.distributed import finalize_model_grads

        self.model.zero_grad_buffer()
        loss = self.forward(self.model, batch)
        loss.backward()
        finalize_model_grads([self.model])
        return loss

    def step(self, batch: object) -> StepResult:
        _sync(self.device)
        t0 = time.perf_counter()
        loss = self.gradients(batch)
        for p in self.params:
            p.grad = p.main_grad.to(p.dtype)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        _sync(self.device)
        result = StepResult(len(self.results), loss.item(), time.perf_counter() - t0)
        self.results.append(result)
        return result


def _identity_grad_sync_on_gloo_cuda(ddp_model: torch.nn.Module, device: torch.device) -> None:
    """Ranks sharing one GPU run over gloo, which cannot do the coalesced all-reduce
    Megatron's DDP issues for CUDA grads. With one data-parallel rank that all-reduce
    is the identity, so it is skipped there (finalize_model_grads' other reductions,
    such as the sequence-parallel norm grads over TP, still run)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if (device.type == "cuda" and hasattr(ddp_model, "finish_grad_sync")
            and parallel_state.get_data_parallel_world_size(with_context_parallel=True) == 1
            and dist.get_backend(parallel_state.get_data_parallel_group(with_context_parallel=True))
            == "gloo"):
        ddp_model.finish_grad_sync = lambda *args, **kwargs: None

