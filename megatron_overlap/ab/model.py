"""The GPT model of the end-to-end A/B runs (the A/B main job and the step
benchmark): megatron-core's GPTModel from the local spec, Megatron's DDP, and
learnable fixed batches that every arm sees identically.

On CPU, megatron-core needs three small shims (its buffers, the CUDA stream and
RNG tracker); they stay in the test helpers, so the caller passes their init.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from .launch import Layout, init_dist


@dataclass(frozen=True)
class GPTSpec:
    layers: int = 2
    hidden: int = 128
    heads: int = 8
    seq: int = 128
    micro_batch: int = 2
    vocab: int = 512
    ffn: int | None = None  # default 4 x hidden


def init_megatron(layout: Layout, rank: int, tp: int, seed: int,
                  cpu_init: Callable[[int, int], None] | None = None) -> torch.device:
    """Process group, Megatron's TP groups and RNG (tests/helpers/megatron_cpu.init on CPU)."""
    if layout.mode == "cpu":
        if cpu_init is None:
            raise ValueError("megatron-core on CPU needs the test suite's shims: pass "
                             "cpu_init=helpers.megatron_cpu.init")
        init_dist(layout, rank)  # gloo, thread count; cpu_init keeps the group it finds
        cpu_init(tp, seed)
        return torch.device("cpu")
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    device = init_dist(layout, rank)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    model_parallel_cuda_manual_seed(seed)
    torch.manual_seed(seed)
    return device


def build_gpt(spec: GPTSpec, tp: int, overlap: bool, dtype: torch.dtype, device: torch.device,
              **config: Any):
    """(model on `device`, wrap: model -> Megatron DDP). Sequence parallel when tp > 1
    (unless `config` says sequence_parallel=False); `overlap` is Megatron's tp_comm_overlap
    (our layers when install() is active); `config`: more TransformerConfig fields (e.g.
    fp8='hybrid', fp8_recipe='tensorwise'; use_cpu_initialization=True on a GPU: the whole
    weights drawn first, then split, so every TP size starts from the same model)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    cpu = device.type == "cpu"
    config = TransformerConfig(
        num_layers=spec.layers, hidden_size=spec.hidden, num_attention_heads=spec.heads,
        ffn_hidden_size=spec.ffn or 4 * spec.hidden, tensor_model_parallel_size=tp,
        sequence_parallel=config.pop("sequence_parallel", True) and tp > 1,
        tp_comm_overlap=overlap, params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        use_cpu_initialization=config.pop("use_cpu_initialization", False) or cpu,
        hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, **config)
    model = GPTModel(config, get_gpt_layer_local_spec(), vocab_size=spec.vocab,
                     max_sequence_length=spec.seq, position_embedding_type="rope")
    if not cpu:
        model.cuda(device)
    if dtype != torch.float32:
        # as Megatron's training does for bf16 / fp16: the module casts every parameter
        # (the local spec's torch norms too) and the first stage's inputs
        from megatron.core.transformer.module import Float16Module
        model = Float16Module(config, model)
    return model, lambda m: DistributedDataParallel(
        config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), m)


def batches(spec: GPTSpec, steps: int, seed: int, device: torch.device) -> Iterator[tuple]:
    """Micro-batches drawn from a small pool of fixed sequences: learnable, so loss
    curves show training, and identical for every arm."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, spec.vocab, (4 * spec.micro_batch, spec.seq + 1), generator=g)
    pos, mask = _positions_and_mask(spec, device)
    for _ in range(steps):
        t = pool[torch.randint(0, len(pool), (spec.micro_batch,), generator=g)].to(device)
        yield t[:, :-1].contiguous(), pos, mask, t[:, 1:].contiguous()


def _positions_and_mask(spec: GPTSpec, device: torch.device) -> tuple:
    """A micro-batch's position ids and causal mask (True where masked), the same every step."""
    mask = torch.triu(torch.ones(spec.seq, spec.seq), diagonal=1).bool()[None, None].to(device)
    pos = torch.arange(spec.seq).unsqueeze(0).expand(spec.micro_batch, -1).to(device)
    return pos, mask


MARKOV_BRANCHING = 4  # markov_batches' successors a token: its loss floor is log of it


def markov_batches(spec: GPTSpec, steps: int, seed: int, device: torch.device,
                   branching: int = MARKOV_BRANCHING) -> Iterator[tuple]:
    """Micro-batches of a random first-order Markov chain over the vocabulary: each token is
    followed by one of `branching` distinct tokens drawn for it once, each equally likely,
    so every label has entropy log(branching) nats: the lowest mean loss a model can reach.
    A distribution to learn, not a pool to memorize: the loss falls towards that floor
    without the plateau a memorized pool falls from, so two arms' curves differ by their
    numerics rather than by when each leaves a plateau. Identical for every arm and rank."""
    if not 1 <= branching <= spec.vocab:
        raise ValueError(f"markov_batches: branching {branching} must be 1..vocab ({spec.vocab})")
    g = torch.Generator().manual_seed(seed)
    successors = torch.empty(spec.vocab, branching, dtype=torch.long)
    for k in range(branching):  # the r-th token not drawn yet for the row: distinct successors
        r = torch.randint(0, spec.vocab - k, (spec.vocab,), generator=g)
        for drawn in successors[:, :k].sort(dim=1).values.t():
            r += (r >= drawn).long()
        successors[:, k] = r
    pos, mask = _positions_and_mask(spec, device)
    for _ in range(steps):
        t = torch.empty(spec.micro_batch, spec.seq + 1, dtype=torch.long)
        t[:, 0] = torch.randint(0, spec.vocab, (spec.micro_batch,), generator=g)
        picks = torch.randint(0, branching, (spec.micro_batch, spec.seq), generator=g)
        for j in range(spec.seq):
            t[:, j + 1] = successors[t[:, j], picks[:, j]]
        t = t.to(device)
        yield t[:, :-1].contiguous(), pos, mask, t[:, 1:].contiguous()


def gpt_loss(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    tokens, pos, mask, labels = batch
    return model(tokens, pos, mask, labels=labels).float().mean()
