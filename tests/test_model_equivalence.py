"""A megatron-core GPTModel built from the local spec after install(): with
tp_comm_overlap=True every layer's linear_qkv / linear_fc1 / linear_proj /
linear_fc2 is ours (the output layer stays Megatron's), sequence parallelism
works with torch norms, and 5 steps of Megatron's own training pieces (its DDP,
finalize_model_grads and optimizer; tests/helpers/gpt.py) equal the plain TP
path on the same weights. Checkpoints
(Megatron's distributed format) move between the two."""

import pytest

from helpers import dist


def _train_pair(rank, world, variant, ckpt_dir):
    import megatron_overlap as mo
    from helpers.gpt import checkpoint_both_ways, make_config, make_model, train
    from helpers.megatron_cpu import init
    from megatron_overlap.comm import stats

    init(world)
    mo.install()
    try:
        plain, wrap_plain = make_model(make_config(world, variant, overlap=False))
        ours, wrap_ours = make_model(make_config(world, variant, overlap=True))
        # checkpoint targets: a plain model for ours' checkpoint and vice versa
        fresh_plain, _ = make_model(make_config(world, variant, overlap=False))
        fresh_ours, _ = make_model(make_config(world, variant, overlap=True))
    finally:
        mo.uninstall()
    ours.load_state_dict(plain.state_dict())
    classes = lambda m: {n: type(x).__name__ for n, x in m.named_modules()  # noqa: E731
                         if n.endswith(("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2",
                                        "output_layer", "layernorm", "final_layernorm"))}
    norm_sp = {n: getattr(p, "sequence_parallel", None) for n, p in ours.named_parameters()
               if "layernorm" in n}
    initial = [p.detach().clone() for p in plain.parameters()]
    stats.snapshot()
    losses_plain = train(wrap_plain(plain))
    stats.snapshot()
    losses_ours = train(wrap_ours(ours))
    moved = stats.snapshot()
    from megatron_overlap.ab.compare import rel_error as rel
    param_err = {n: rel(p, q) for (n, p), (_, q) in zip(ours.named_parameters(), plain.named_parameters())}
    norms = {n: p.detach().clone() for n, p in ours.named_parameters() if "layernorm" in n}
    stepped = min(rel(p.detach(), q) for p, q in zip(plain.parameters(), initial))

    # Checkpoints in Megatron's distributed format, each way: ours -> plain, plain -> ours.
    ckpt_err = checkpoint_both_ways(rank, ckpt_dir, ours, plain, fresh_ours, fresh_plain)
    return dict(classes=classes(ours), plain_classes=classes(plain), norm_sp=norm_sp,
                losses=(losses_plain, losses_ours), param_err=param_err, moved=moved,
                norms=norms, ckpt_err=ckpt_err, stepped=stepped)


CASES = [(tp, v) for tp in (2, 4) for v in ("gelu_bias", "swiglu_gqa_rms")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"tp{c[0]}-{c[1]}")
def trained(request, tmp_path_factory):
    tp, variant = request.param
    return tp, dist.run(_train_pair, tp, variant, str(tmp_path_factory.mktemp("ckpt")), timeout=400)


def test_every_transformer_layer_uses_overlapped_linears(trained):
    _, per_rank = trained
    classes = per_rank[0]["classes"]
    for layer in (0, 1):
        for attr, cls in (("self_attention.linear_qkv", "OverlapColumnParallelLinear"),
                          ("self_attention.linear_proj", "OverlapRowParallelLinear"),
                          ("mlp.linear_fc1", "OverlapColumnParallelLinear"),
                          ("mlp.linear_fc2", "OverlapRowParallelLinear")):
            assert classes[f"decoder.layers.{layer}.{attr}"] == cls
    assert classes["output_layer"] == "ColumnParallelLinear"
    assert "Overlap" not in "".join(per_rank[0]["plain_classes"].values())


def test_training_matches_plain_tp_path(trained):
    _, per_rank = trained
    for r in per_rank:
        plain, ours = r["losses"]
        assert ours == pytest.approx(plain, rel=1e-5)
        assert r["stepped"] > 0.0  # Megatron's optimizer moved every parameter
        bad = {n: e for n, e in r["param_err"].items() if not e <= 1e-5}
        assert not bad, bad
        # the overlap really ran: every pass moved bytes through the transport
        ops = set(r["moved"])
        assert {"qkv_fprop", "qkv_dgrad", "qkv_wgrad", "proj_fprop", "proj_dgrad",
                "fc1_fprop", "fc2_fprop"} <= ops, ops


def test_sequence_parallel_torch_norms_reduce_their_grads(trained):
    _, per_rank = trained
    assert per_rank[0]["norm_sp"] and all(per_rank[0]["norm_sp"].values())
    # each rank normalised different tokens; only summed grads keep the copies equal
    for name, value in per_rank[0]["norms"].items():
        for other in per_rank[1:]:
            assert (other["norms"][name] - value).abs().max().item() == 0.0, name


def test_checkpoint_moves_between_overlap_and_plain(trained):
    _, per_rank = trained
    for r in per_rank:
        assert r["ckpt_err"] == {"ours_to_plain": 0.0, "plain_to_ours": 0.0}
