"""Megatron-LM's pretrain_gpt.py with its ranks sharing one GPU (benchmarks only).

    torchrun --nproc-per-node 2 benchmarks/megatron_lm_shared_gpu.py TREE/pretrain_gpt.py ARGS

is `torchrun ... -m megatron_overlap.megatron_lm TREE/pretrain_gpt.py ARGS` with what the
shared-GPU layout (gloo process group, `--local-rank 0` on every rank) needs and the
library must not do:

- Megatron DDP's gradient buckets are all-reduced one by one: its coalesced call is
  refused by gloo for CUDA tensors ("allreduce_coalesced: unsupported device type cuda").
  Synchronous only (no --overlap-grad-reduce).
- Megatron's `make` of its C++ dataset helpers is skipped: the tree must hold a prebuilt
  megatron/core/datasets/helpers_cpp*.so (benchmarks/megatron_lm_trees.sh copies the one
  of the megatron-core wheel), which is imported instead.
- Where there is no CUDA toolkit (pip's torch has none), core_v0.14-0.16's
  `fused_kernels.load`, which builds nothing but asks nvcc for its version, is skipped.
- `--sft`: Hugging Face's `datasets` stood in for where it does not import, and
  `transformers.AutoTokenizer` always (benchmarks/sft_standins.py: JSON lines, a byte
  tokenizer; the GPU machine has transformers but no network).
- `MLM_DETERMINISTIC=1`: torch's deterministic algorithms on (its flash attention's
  backward, varlen's too, otherwise accumulates dq in whatever order its blocks finish;
  Megatron-LM's own --deterministic-mode refuses --tp-comm-overlap, so the overlap's arm
  could not take it). CUBLAS_WORKSPACE_CONFIG must be set too (megatron_lm_parity.sh does).
- At exit, each rank prints `MLM-PARITY-LAYERS {json}`: how many of our attention modules and overlapped
  layers were built (benchmarks/megatron_lm_parity.py checks each arm's count) and how
  many calls of our attention got packed sequences (`packed_attention_calls`), and
  `MLM-REPLAYS {json}`: per training iteration, how many layer passes ran, how many of
  them replayed a CUDA graph captured earlier, how many were captured, how many graphs
  were evicted (`overlap.replay.totals`).

TREE must come first on PYTHONPATH (the shim imports megatron before the entry point).
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import json
import os
import runpy
import sys
from collections import Counter
from typing import Any, Iterator

BUILT: Counter = Counter()
PER_ITER: list[list[int]] = []  # [calls, replays, captures, evictions] of each train_step


class _Done:
    """The handle of ops that already completed."""

    def wait(self) -> None:
        pass


@contextlib.contextmanager
def _one_by_one(group: Any = None, device: Any = None, async_ops: bool = False) -> Iterator[_Done]:
    """Stands in for torch.distributed._coalescing_manager: the collectives inside run
    one by one, synchronously."""
    if async_ops:
        raise RuntimeError("megatron_lm_shared_gpu: asynchronous coalesced collectives "
                           "(--overlap-grad-reduce / --overlap-param-gather) are not "
                           "supported on the shared-GPU gloo layout")
    yield _Done()


def _prebuilt_helpers() -> None:
    """Instead of Megatron's `make -C megatron/core/datasets`."""
    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401
    except ImportError as e:
        raise SystemExit("megatron_lm_shared_gpu: no prebuilt megatron/core/datasets/helpers_cpp "
                         f"for this Python in the tree ({e}); run benchmarks/megatron_lm_trees.sh") from e


def _count_builds() -> None:
    from megatron_overlap.attention import TorchDotProductAttention
    from megatron_overlap.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear

    def counting(cls: type) -> Any:
        init = cls.__dict__["__init__"]

        def __init__(self, *args, **kwargs):
            init(self, *args, **kwargs)
            if isinstance(self, cls):  # (our attention turns back into Megatron's where it must)
                BUILT[cls.__name__] += 1
        return __init__

    for cls in (OverlapColumnParallelLinear, OverlapRowParallelLinear, TorchDotProductAttention):
        cls.__init__ = counting(cls)
    forward = TorchDotProductAttention.forward
    params = inspect.signature(forward)

    def counted_forward(self, *args, **kwargs):
        if params.bind(self, *args, **kwargs).arguments.get("packed_seq_params") is not None:
            BUILT["packed_attention_calls"] += 1  # a THD batch (cu_seqlens) reached our attention
        return forward(self, *args, **kwargs)

    TorchDotProductAttention.forward = counted_forward
    atexit.register(lambda: print("MLM-PARITY-LAYERS " + json.dumps(
        {"rank": int(os.environ.get("RANK", 0)), **BUILT}), flush=True))


def _count_replays() -> None:
    """Wrap Megatron-LM's train_step (looked up by name from its train loop) to note how
    each iteration's layer passes ran."""
    from megatron.training import training

    from megatron_overlap.overlap import replay

    step = training.train_step

    def train_step(*args, **kwargs):
        before = replay.totals()
        out = step(*args, **kwargs)
        after = replay.totals()
        PER_ITER.append([after[k] - before[k] for k in ("calls", "replays", "captures", "evictions")])
        return out

    training.train_step = train_step
    atexit.register(lambda: print("MLM-REPLAYS " + json.dumps(
        {"rank": int(os.environ.get("RANK", 0)), "per_iter": PER_ITER}), flush=True))


def install_shims() -> None:
    from megatron.core.datasets import utils as dataset_utils
    from megatron.core.distributed import param_and_grad_buffer

    if "--sft" in sys.argv:  # Hugging Face's loaders (sft_standins.install says which)
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import sft_standins
        sft_standins.install()

    if os.environ.get("MLM_DETERMINISTIC") == "1":
        import torch
        torch.use_deterministic_algorithms(True)
    param_and_grad_buffer._coalescing_manager = _one_by_one
    dataset_utils.compile_helpers = _prebuilt_helpers
    try:  # core_v0.14-0.16: load() builds no kernel, it only runs `$CUDA_HOME/bin/nvcc -V`
        from megatron.legacy import fused_kernels
        from torch.utils import cpp_extension
    except ImportError:
        fused_kernels = None
    if fused_kernels is not None and cpp_extension.CUDA_HOME is None:
        fused_kernels.load = lambda *args, **kwargs: None
    _count_builds()
    _count_replays()


if __name__ == "__main__":
    install_shims()
    sys.argv = ["megatron_overlap.megatron_lm", *sys.argv[1:]]
    runpy.run_module("megatron_overlap.megatron_lm", run_name="__main__", alter_sys=True)
