"""A megatron-core GPTModel (local spec, after install()) configured with Megatron's own
FP8 fields (fp8='hybrid', fp8_recipe='tensorwise') trains in FP8 in its overlapped
linears: 5 steps of Megatron's own training pieces (tests/helpers/gpt.py) against the
same model without FP8, checkpoints moving both ways between the FP8 and the plain
model, Megatron's per-layer bf16 rule honoured, and Megatron's default recipe
(delayed) refused when the model is built. And row-wise scaling
(install(fp8_scaling='rowwise'), bf16 parameters, the wgrad in bf16) against the same
bf16 model without FP8, with the same tolerances.

Tolerances of FP8 against the model without FP8 (fp32 parameters, so the difference is
FP8's alone), measured here at loss <= 3e-4 relative and update 5-6%:
- every step's loss within 5e-3 relative: the loss of this small untrained model is a
  mean of log-softmaxes near log(64) = 4.2 whose logits move by FP8's rounding only;
- the weights' total update over the 5 steps within 15% (norm) of the update without
  FP8: an e5m2 gradient keeps 2 mantissa bits (rounding error up to 2^-3 relative), an
  e4m3 input 3; the wgrad's sums over 32 tokens average that down to the measured 5-6%,
  and a dequantization off by a factor (a wrong scale) moves the update by that factor.
"""

import pytest

from helpers import dist
from megatron_overlap.ab.compare import rel_error

LOSS_RTOL, UPDATE_RTOL = 5e-3, 0.15


def _train(rank, world, variant, ckpt_dir, recipe="tensorwise"):
    import torch

    import megatron_overlap as mo
    from helpers.gpt import checkpoint_both_ways, checkpoint_into, make_config, make_model, train
    from helpers.megatron_cpu import init
    from megatron_overlap.comm import stats
    from megatron_overlap.config import ConfigError

    init(world)
    fp8 = dict(fp8="hybrid", fp8_recipe=recipe, **(DELAYED if recipe == "delayed" else {}))
    mo.install()
    try:
        plain, wrap_plain = make_model(make_config(world, variant, overlap=False))
        ours, wrap_ours = make_model(make_config(world, variant, overlap=True, **fp8))
        fresh_plain, _ = make_model(make_config(world, variant, overlap=False))
        fresh_ours, _ = make_model(make_config(world, variant, overlap=True, **fp8))
        again, _ = make_model(make_config(world, variant, overlap=True, **fp8))
        # (Megatron refuses first_last_layers_bf16 with delayed scaling itself)
        bf16_end, _ = make_model(make_config(world, variant, overlap=True, fp8="hybrid",
                                             fp8_recipe="tensorwise",
                                             first_last_layers_bf16=True,
                                             num_layers_at_start_in_bf16=0,
                                             num_layers_at_end_in_bf16=1))
        try:  # delayed scaling under full recompute: refused
            make_model(make_config(world, variant, overlap=True, fp8="hybrid",
                                   recompute_granularity="full", recompute_method="uniform",
                                   recompute_num_layers=1))
            delayed = "built"
        except ConfigError as exc:
            delayed = str(exc)
    finally:
        mo.uninstall()
    ours.load_state_dict(plain.state_dict())
    initial = [p.detach().clone() for p in plain.parameters()]
    precision = lambda m: {n: x.precision.describe() for n, x in m.named_modules()  # noqa: E731
                           if hasattr(x, "precision")}
    stats.snapshot()
    losses_plain = train(wrap_plain(plain))
    stats.snapshot()
    losses_ours = train(wrap_ours(ours))
    moved = stats.snapshot()
    # how far FP8 moved the weights from where the model without FP8 moved them
    delta = lambda m: torch.cat([(p.detach() - p0).flatten()  # noqa: E731
                                 for p, p0 in zip(m.parameters(), initial)])
    update_err = rel_error(delta(ours), delta(plain))
    ckpt_err = checkpoint_both_ways(rank, ckpt_dir, ours, plain, fresh_ours, fresh_plain)
    # ours into ours: the delayed-scaling histories (the linears' extra state) come back
    checkpoint_into(rank, f"{ckpt_dir}/ours_to_ours", ours, again)
    extra = lambda m: {n: x.get_extra_state() for n, x in m.named_modules()  # noqa: E731
                       if hasattr(x, "precision")}
    kept, back = extra(ours), extra(again)
    histories = {n: None if v is None else {r: h.tolist() for r, h in v["amax_history"].items()}
                 for n, v in kept.items()}
    restored = kept.keys() == back.keys() and all(
        (v is None and back[n] is None) or all(torch.equal(h, back[n]["amax_history"][r])
                                               and torch.equal(v["scale"][r], back[n]["scale"][r])
                                               for r, h in v["amax_history"].items())
        for n, v in kept.items())
    # a plain checkpoint loaded into an FP8 model trains on in FP8 from the same weights
    finite = all(torch.isfinite(torch.tensor(train(wrap_ours(fresh_ours), steps=1))))
    return dict(losses=(losses_plain, losses_ours), update_err=update_err, precision=precision(ours),
                bf16_end=precision(bf16_end), delayed=delayed, ckpt_err=ckpt_err,
                histories=histories, restored=restored,
                moved={k: v["bytes"] for k, v in moved.items()}, finite=finite,
                classes={n: type(x).__name__ for n, x in ours.named_modules()
                         if n.endswith(("linear_qkv", "output_layer"))})


CASES = [(2, "gelu_bias", "tensorwise"), (4, "swiglu_gqa_rms", "tensorwise"),
         (2, "gelu_bias", "delayed")]
# delayed scaling as Transformer Engine users run it: the largest of 16 amaxes
DELAYED = dict(fp8_amax_history_len=16, fp8_amax_compute_algo="max", tp_only_amax_red=True)


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"tp{c[0]}-{c[1]}-{c[2]}")
def trained(request, tmp_path_factory):
    tp, variant, recipe = request.param
    return tp, recipe, dist.run(_train, tp, variant, str(tmp_path_factory.mktemp("ckpt")),
                                recipe, timeout=400)


def test_every_overlapped_linear_runs_fp8(trained):
    _, recipe, per_rank = trained
    r = per_rank[0]
    assert len(r["precision"]) == 8  # 2 layers x qkv, proj, fc1, fc2; the output layer is Megatron's
    assert all(p.startswith(f"fp8 {recipe} (e4m3fn fprop, e5m2 grads")
               for p in r["precision"].values()), r["precision"]
    assert r["classes"]["output_layer"] == "ColumnParallelLinear"


def test_fp8_training_is_within_tolerance_of_the_model_without_fp8(trained):
    _, recipe, per_rank = trained
    for r in per_rank:
        plain, ours = r["losses"]
        assert ours == pytest.approx(plain, rel=LOSS_RTOL)
        assert ours != plain  # FP8 ran: its rounding shows in the loss
        assert 0.0 < r["update_err"] <= UPDATE_RTOL
        assert r["finite"]


def test_fp8_gathers_halve_against_bf16_bytes(trained):
    """The forward gathers of qkv and fc1 moved one byte per value: a quarter of the
    fp32 parameters' four, half of bf16's two (the model's activations are fp32)."""
    tp, _, per_rank = trained
    from helpers.gpt import BATCH, SEQ

    moved = per_rank[0]["moved"]
    tokens, hidden, steps, layers = SEQ * BATCH, 64, 5, 2
    ring = tokens // tp * hidden * (tp - 1)  # the blocks a rank receives over a ring
    assert moved["qkv_fprop"] == moved["fc1_fprop"] == steps * layers * ring
    assert moved["proj_fprop"] > 0  # the reduce-scatters stay in the activations' dtype


def test_checkpoints_move_both_ways_between_fp8_and_plain(trained):
    _, recipe, per_rank = trained
    for r in per_rank:
        assert r["ckpt_err"] == {"ours_to_plain": 0.0, "plain_to_ours": 0.0}


def test_delayed_histories_come_back_through_megatrons_checkpoint(trained):
    """Saved and loaded through Megatron's distributed checkpoint (the linears' extra
    state, TP rank 0's: every TP rank's histories are the same), into a model of ours:
    the same histories and scales. Tensorwise keeps none (None, as Megatron's linears)."""
    _, recipe, per_rank = trained
    for r in per_rank:
        assert r["restored"]
        hist = r["histories"]
        if recipe == "tensorwise":
            assert set(hist.values()) == {None}
            continue
        assert len(hist) == 8 and all(set(h) == {"input", "weight", "grad"} for h in hist.values())
        # 5 steps into a history of 16: 11 empty slots, then 5 amaxes (the weight's each step)
        assert all(len(v) == 16 and v[:11] == [0.0] * 11 and min(v[11:]) > 0
                   for h in hist.values() for v in h.values()), hist
    assert per_rank[0]["histories"] == per_rank[1]["histories"]  # the TP group's amaxes


def test_megatrons_bf16_layers_and_default_recipe(trained):
    _, recipe, per_rank = trained
    r = per_rank[0]
    last = {n: p for n, p in r["bf16_end"].items() if n.startswith("decoder.layers.1.")}
    first = {n: p for n, p in r["bf16_end"].items() if n.startswith("decoder.layers.0.")}
    assert len(last) == len(first) == 4
    assert all(p.startswith("bf16 (first_last_layers_bf16: layer 2 of 2") for p in last.values())
    assert all(p.startswith("fp8 tensorwise") for p in first.values())
    # Megatron's default recipe builds (the model above); under full recompute it is refused
    assert "fp8_recipe='delayed'" in r["delayed"] and "recompute" in r["delayed"]


# -- row-wise scaling (install(fp8_scaling='rowwise')): bf16 parameters, the wgrad in bf16 ----
def _train_rowwise(rank, world, variant):
    import torch

    import megatron_overlap as mo
    from helpers.gpt import make_config, make_model, train
    from helpers.megatron_cpu import init
    from megatron_overlap.comm import stats

    init(world)
    bf16 = dict(params_dtype=torch.bfloat16, bf16=True)
    fp8 = dict(fp8="hybrid", fp8_recipe="tensorwise", fp8_wgrad=False, **bf16)
    mo.install(fp8_scaling="rowwise")
    try:
        plain, wrap_plain = make_model(make_config(world, variant, overlap=False, **bf16))
        ours, wrap_ours = make_model(make_config(world, variant, overlap=True, **fp8))
        same, wrap_same = make_model(make_config(world, variant, overlap=True, **bf16))
    finally:
        mo.uninstall()
    ours.load_state_dict(plain.state_dict())
    same.load_state_dict(plain.state_dict())
    initial = [p.detach().float().clone() for p in plain.parameters()]
    losses_plain = train(wrap_plain(plain), bf16=True)
    losses_same = train(wrap_same(same), bf16=True)
    stats.snapshot()
    losses_ours = train(wrap_ours(ours), bf16=True)
    moved = stats.snapshot()
    delta = lambda m: torch.cat([(p.detach().float() - p0).flatten()  # noqa: E731
                                 for p, p0 in zip(m.parameters(), initial)])
    err = lambda m: rel_error(delta(m), delta(plain))  # noqa: E731
    return dict(losses=(losses_plain, losses_same, losses_ours), update_err=err(ours),
                update_err_bf16=err(same), moved={k: v["bytes"] for k, v in moved.items()},
                precision={n: x.precision.describe() for n, x in ours.named_modules()
                           if hasattr(x, "precision")})


@pytest.fixture(scope="module", params=CASES[:2], ids=lambda c: f"tp{c[0]}-{c[1]}")
def trained_rowwise(request):
    tp, variant, _ = request.param
    return tp, dist.run(_train_rowwise, tp, variant, timeout=400)


def test_rowwise_training_is_within_tolerance_of_the_bf16_model(trained_rowwise):
    """The same tolerances as tensorwise's (measured: loss <= 2e-4, update 5-6%), against
    the same model in bf16 (Megatron's layers); our layers without FP8 (`same`) stay
    within the bf16 tolerance of it, so the difference is FP8's."""
    _, per_rank = trained_rowwise
    for r in per_rank:
        assert len(r["precision"]) == 8 and all(
            p == "fp8 rowwise (e4m3fn fprop, e5m2 grads, wgrad high precision, fast accumulation: fprop)"
            for p in r["precision"].values()), r["precision"]
        plain, same, ours = r["losses"]
        assert same == pytest.approx(plain, rel=1e-2) and r["update_err_bf16"] <= 1e-2
        assert ours == pytest.approx(plain, rel=LOSS_RTOL) and ours != plain
        assert r["update_err_bf16"] < r["update_err"] <= UPDATE_RTOL


def test_rowwise_gathers_carry_each_rows_scale(trained_rowwise):
    """qkv's and fc1's forward gathers move each token's 64 FP8 values and its 16-byte
    scale tail; no amax exchange."""
    tp, per_rank = trained_rowwise
    from helpers.gpt import BATCH, SEQ

    moved = per_rank[0]["moved"]
    ring = SEQ * BATCH // tp * (tp - 1)  # the rows a rank receives over a ring
    assert moved["qkv_fprop"] == moved["fc1_fprop"] == 5 * 2 * ring * (64 + 16)
    assert not any(op.endswith("_amax") for op in moved)
