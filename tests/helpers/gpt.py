"""A small megatron-core GPTModel from the local spec, trained a few steps with
Megatron's DDP and gradient finalisation (CPU, or a GPU with `device`)."""

from __future__ import annotations

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

    return TransformerConfig(
        num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=8,
        tensor_model_parallel_size=tp, sequence_parallel=tp > 1, tp_comm_overlap=overlap,
        use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0,
        attention_dropout=0.0, bias_dropout_fusion=False, apply_rope_fusion=False,
        masked_softmax_fusion=False, gradient_accumulation_fusion=False,
        **VARIANTS[variant], **extra)


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


def train(ddp, steps: int = 5, lr: float = 0.05, device: str = "cpu") -> list[float]:
    """SGD with momentum through the A/B tool's training arm (Megatron's
    finalize_model_grads, then main_grad is the gradient)."""
    from megatron_overlap.ab import TrainArm

    arm = TrainArm("test", ddp, forward, lambda ps: torch.optim.SGD(ps, lr=lr, momentum=0.9))
    return [arm.step(batch(step, device)).loss for step in range(steps)]
