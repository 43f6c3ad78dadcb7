"""A GPT whose layers include MoE (megatron-core's local spec with experts, the
alltoall and allgather token dispatchers, TP=2 with sequence parallelism, expert
TP 1): attention (and the shared expert's TP linears) overlapped, the routed
experts Megatron's own; 5 training steps equal Megatron's path on the same weights,
and checkpoints move both ways."""

import pytest

from helpers import dist

MOE = dict(num_moe_experts=4, moe_router_topk=2, expert_model_parallel_size=1,
           expert_tensor_parallel_size=1, moe_aux_loss_coeff=0.0, moe_shared_expert_intermediate_size=64,
           moe_grouped_gemm=False)


def _cpu_streams() -> None:
    """Megatron's alltoall dispatcher copies token counts to the host on a side CUDA
    stream; on CPU every op is already ordered, so streams and their events stand in
    (a test shim beside helpers.megatron_cpu's, never in the library)."""
    import contextlib

    import torch

    class _Event:
        def synchronize(self):
            pass

        def wait(self, *_):
            pass

    class _Stream:
        def __init__(self, *_, **__):
            pass

        def wait_stream(self, *_):
            pass

        def wait_event(self, *_):
            pass

        def record_event(self, *_):
            return _Event()

        def synchronize(self):
            pass

    torch.cuda.Stream = _Stream  # type: ignore[assignment,misc]
    real_stream = torch.cuda.stream
    torch.cuda.stream = lambda s: (contextlib.nullcontext() if s is None or isinstance(s, _Stream)  # type: ignore
                                   else real_stream(s))
    torch.Tensor.record_stream = lambda self, stream: None  # type: ignore[method-assign]
    # megatron-core 0.16's router names te_general_gemm without defining it when
    # Transformer Engine is absent (a NameError on any device): what it means is None.
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _moe_pair(rank, world, dispatcher, ckpt_dir):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    import megatron_overlap as mo
    from helpers.gpt import checkpoint_both_ways, make_config, make_model, train
    from helpers.megatron_cpu import init

    init(world)
    _cpu_streams()
    extra = dict(MOE, moe_token_dispatcher_type=dispatcher)
    spec = lambda: get_gpt_layer_local_spec(num_experts=4, normalization="RMSNorm")  # noqa: E731
    mo.install()
    try:
        plain, wrap_plain = make_model(make_config(world, "swiglu_gqa_rms", overlap=False, **extra), spec())
        ours, wrap_ours = make_model(make_config(world, "swiglu_gqa_rms", overlap=True, **extra), spec())
        fresh_plain, _ = make_model(make_config(world, "swiglu_gqa_rms", overlap=False, **extra), spec())
        fresh_ours, _ = make_model(make_config(world, "swiglu_gqa_rms", overlap=True, **extra), spec())
    finally:
        mo.uninstall()
    ours.load_state_dict(plain.state_dict())
    classes = {n: type(m).__name__ for n, m in ours.named_modules()
               if n.endswith(("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"))}
    from megatron_overlap.comm import stats

    losses_plain = train(wrap_plain(plain))
    stats.snapshot()
    losses_ours = train(wrap_ours(ours))
    moved = set(stats.snapshot())
    from megatron_overlap.ab.compare import rel_error as rel
    param_err = max(rel(p, q) for p, q in zip(ours.parameters(), plain.parameters()))
    ckpt_err = checkpoint_both_ways(rank, ckpt_dir, ours, plain, fresh_ours, fresh_plain,
                                    tag=f"{dispatcher}_")
    return dict(classes=classes, losses=(losses_plain, losses_ours), param_err=param_err,
                ckpt_err=ckpt_err, moved=moved)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_moe_gpt_trains_like_megatron_and_checkpoints_move(dispatcher, tmp_path):
    per_rank = dist.run(_moe_pair, 2, dispatcher, str(tmp_path), timeout=400)
    classes = per_rank[0]["classes"]
    attention = {n: c for n, c in classes.items() if "self_attention" in n}
    experts = {n: c for n, c in classes.items() if ".experts." in n}
    shared = {n: c for n, c in classes.items() if "shared_experts" in n}
    assert attention and all(c.startswith("Overlap") for c in attention.values()), attention
    assert experts and not any(c.startswith("Overlap") for c in experts.values()), experts
    assert shared and all(c.startswith("Overlap") for c in shared.values()), shared
    for r in per_rank:
        plain, ours = r["losses"]
        assert ours == pytest.approx(plain, rel=1e-5)
        assert r["param_err"] <= 1e-5
        assert r["ckpt_err"] == {"ours_to_plain": 0.0, "plain_to_ours": 0.0}
        # the overlap really ran: attention's and the shared expert's passes moved bytes
        assert {"qkv_fprop", "qkv_dgrad", "proj_fprop", "proj_dgrad", "fc1_fprop",
                "fc2_fprop"} <= r["moved"], r["moved"]
