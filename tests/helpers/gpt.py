"""A small megatron-core GPTModel from the local spec, trained a few steps with
Megatron's own pieces only: its DDP, `finalize_model_grads` and optimizer (CPU, or
a GPU with `device`). This is the reference side of the model tests, so it uses no
training code of megatron_overlap (not `megatron_overlap.ab`)."""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

VARIANTS = {
    # GELU MLP with biases, LayerNorm, MHA
    "gelu_bias": dict(add_bias_linear=True, normalization="LayerNorm", gated_linear_unit=False,
                      activation_func=F.gelu, num_query_groups=None),
    # SwiGLU, GQA, no biases, RMSNorm
    "swiglu_gqa_rms": dict(add_bias_linear=False, normalization="RMSNorm", gated_linear_unit=True,
                           activation_func=F.silu, num_query_groups=4),
}
VOCAB, SEQ, BATCH = 64, 16, 2


def make_config(tp: int, variant: str, overlap: bool, **extra):
    from megatron.core.transformer import TransformerConfig

    kw = dict(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=8,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1, tp_comm_overlap=overlap,
        use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False, **VARIANTS[variant])
    return TransformerConfig(**{**kw, **extra})  # extra may override (params_dtype, bf16)


def make_model(config, spec=None):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = spec or get_gpt_layer_local_spec(normalization=config.normalization)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                     position_embedding_type="rope")
    return model, lambda m: DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), m)


def batch(step: int, device: str = "cpu"):
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    causal = torch.triu(torch.ones(SEQ, SEQ), diagonal=1).bool()[None, None]  # True = masked
    out = tokens[:, :-1].contiguous(), pos, causal, tokens[:, 1:].contiguous()
    return tuple(t.to(device) for t in out)


def forward(model, b):
    tokens, pos, mask, labels = b
    return model(tokens, pos, mask, labels=labels).float().mean()


def forward_backward(ddp, b, microbatches: int = 1) -> float:
    """`microbatches` forwards and backwards of the batch through Megatron's own schedule
    (`get_forward_backward_func`, no pipelining; it sets the model's is_first_microbatch at
    the first), which is also where Megatron's local CUDA graphs are created (at the end of
    the step that recorded them). The first micro-batch's loss."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def step(data_iterator, model):
        tokens, pos, mask, labels = next(data_iterator)
        out = model(tokens, pos, mask, labels=labels)

        def loss_func(output):
            loss = output.float().mean()
            return loss, {"loss": loss.detach()}
        return out, loss_func

    reduced = get_forward_backward_func()(
        forward_step_func=step, data_iterator=iter([b] * microbatches), model=[ddp],
        num_microbatches=microbatches,
        seq_length=SEQ, micro_batch_size=BATCH, forward_only=False)
    return reduced[0]["loss"].item()


def train(ddp, steps: int = 5, lr: float = 0.05, device: str = "cpu", schedule: bool = False,
          after_step=None, bf16: bool = False, microbatches: int = 1) -> list[float]:
    """Megatron's own training step, as `megatron.training.train_step` runs it:
    zero DDP's grad buffer and the optimizer, forward and backward (directly, or
    through Megatron's schedule with `schedule`, `microbatches` per step), `finalize_model_grads`, then
    Megatron's optimizer (`get_megatron_optimizer`: SGD with momentum, no weight
    decay, no clipping) steps on each `main_grad`; `after_step(step)` is called after
    each. `bf16`: bf16 parameters; Megatron's optimizer for them takes CUDA tensors
    only, so on CPU `Bf16Sgd` does its step (the same SGD on fp32 master copies).
    Nothing of megatron_overlap runs here beyond the model's own layers."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    from helpers.megatron_cpu import cuda_tensors_on_cpu

    config = OptimizerConfig(optimizer="sgd", lr=lr, sgd_momentum=0.9, weight_decay=0.0,
                             clip_grad=0.0, bf16=bf16, fp16=False,
                             use_distributed_optimizer=False)
    # On CPU, Megatron's optimizer makes its loss scale and grad-norm buffers on 'cuda'.
    on_device = cuda_tensors_on_cpu if device == "cpu" else contextlib.nullcontext
    if device != "cpu":
        skip_dp_all_reduce_on_gloo_cuda(ddp)
    if bf16 and device == "cpu":
        optimizer = Bf16Sgd(ddp, lr)
    else:
        with on_device():
            optimizer = get_megatron_optimizer(config, [ddp])
    losses = []
    for step in range(steps):
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        if schedule:
            with on_device():  # (the schedule counts tokens in a tensor it makes on 'cuda')
                losses.append(forward_backward(ddp, batch(step, device), microbatches))
        else:
            loss = forward(ddp, batch(step, device))
            loss.backward()
            losses.append(loss.item())
        finalize_model_grads([ddp])
        with on_device():
            ok, _, _ = optimizer.step()
        assert ok, f"Megatron's optimizer skipped step {step}"
        if after_step is not None:
            after_step(step)
    return losses


class Bf16Sgd:
    """Megatron's bf16 optimizer step on CPU: SGD with momentum 0.9 on fp32 master
    copies of the bf16 parameters, from each `main_grad`, copied back rounded."""

    def __init__(self, ddp, lr: float):
        self.params = [p for p in ddp.parameters() if p.requires_grad]
        self.master = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.sgd = torch.optim.SGD(self.master, lr=lr, momentum=0.9)

    def zero_grad(self) -> None:
        self.sgd.zero_grad()

    def step(self):
        for m, p in zip(self.master, self.params):
            m.grad = p.main_grad.float()
        self.sgd.step()
        with torch.no_grad():
            for m, p in zip(self.master, self.params):
                p.copy_(m)
        return True, None, None


def skip_dp_all_reduce_on_gloo_cuda(ddp) -> None:
    """Ranks sharing one GPU run over gloo, which cannot do the coalesced all-reduce
    Megatron's DDP issues for CUDA grads. With one data-parallel rank that all-reduce
    is the identity, so it is skipped (finalize_model_grads' other reductions, such as
    the sequence-parallel norm grads over TP, still run). A test-harness shim."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if (parallel_state.get_data_parallel_world_size(with_context_parallel=True) == 1
            and dist.get_backend(group) == "gloo"):
        ddp.finish_grad_sync = lambda *args, **kwargs: None


def checkpoint_into(rank: int, path: str, src, dst) -> None:
    """A Megatron distributed checkpoint of `src` saved at `path` and loaded into `dst`.
    Nothing but `_extra_state` may be missing or unexpected."""
    import os

    from megatron.core import dist_checkpointing, parallel_state

    meta = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    if rank == 0:
        os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(src.sharded_state_dict(metadata=meta), path)
    loaded = dist_checkpointing.load(dst.sharded_state_dict(metadata=meta), path)
    missing, unexpected = dst.load_state_dict(loaded, strict=False)
    assert not [k for k in missing + unexpected if not k.endswith("_extra_state")], (missing, unexpected)


def checkpoint_both_ways(rank: int, ckpt_dir: str, ours, plain, fresh_ours, fresh_plain,
                         tag: str = "") -> dict[str, float]:
    """Megatron distributed checkpoints each way (ours -> a fresh plain model, plain -> a
    fresh one of ours); per direction, the largest relative parameter difference after
    loading."""
    import os

    from megatron_overlap.ab.compare import rel_error as rel
    err = {}
    for label, src, dst in (("ours_to_plain", ours, fresh_plain), ("plain_to_ours", plain, fresh_ours)):
        checkpoint_into(rank, os.path.join(ckpt_dir, tag + label), src, dst)
        err[label] = max(rel(p, q) for p, q in zip(dst.parameters(), src.parameters()))
    return err
