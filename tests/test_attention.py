"""The core attention install() puts into the local spec (megatron_overlap.attention) on
CPU in fp32, where torch's SDPA runs its math backend: equal to Megatron's
DotProductAttention within 1e-5 (relative, output and q/k/v grads) for every mask type,
MHA / GQA / MQA, softmax_scale, query-key layer scaling, kv_channels != hidden / heads,
sq != sk, sliding windows and head dim 256; packed (THD) sequences equal to each document
run alone; dropout reproducible under one seed, forked per TP rank, off in eval, and
recomputed exactly under selective recompute; a GPTModel trained 5 steps equal to the
same model on Megatron's attention, checkpoints both ways; what it cannot run keeps
Megatron's class with the reason reported."""

import pytest
import torch

from helpers import dist
from helpers.attention import CASES, rel

TOL = 1e-5


def _equivalence(rank, world):
    from helpers.attention import compare
    from helpers.megatron_cpu import init

    init(world)
    return {case.name: compare(case, torch.float32, "cpu", world) for case in CASES}


@pytest.fixture(scope="module")
def equivalence():
    return dist.run(_equivalence, 1, timeout=300)[0]


@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_equals_megatrons_dot_product_attention(equivalence, case):
    errs = equivalence[case]
    assert all(e <= TOL for e in errs.values()), errs


def _tp2_heads(rank, world):
    """At TP=2 each rank holds its share of heads and groups (GQA 8:2 -> 4:1) and equals
    Megatron's on it."""
    from helpers.attention import Case, compare
    from helpers.megatron_cpu import init

    init(world)
    return compare(Case("tp2_gqa", groups=2), torch.float32, "cpu", tp=world)


def test_tensor_parallel_shares_of_heads_equal_megatron():
    for errs in dist.run(_tp2_heads, 2, timeout=200):
        assert all(e <= TOL for e in errs.values()), errs


# -- packed sequences (THD) ------------------------------------------------------------------
def _packed(rank, world):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from helpers.attention import Case, config, run
    from helpers.megatron_cpu import init
    from megatron_overlap.attention import TorchDotProductAttention

    init(world)
    out = {}
    lengths = [5, 9, 2, 8]
    for name, mask_type, groups, window, pad in (
            ("causal_gqa", "causal", 2, None, 0), ("padding_causal_mqa", "padding_causal", 1, None, 0),
            ("no_mask", "no_mask", 8, None, 0), ("causal_window", "causal", 2, (3, 0), 0),
            ("causal_padded_apart", "causal", 2, None, 3)):
        case = Case(name, groups=groups, mask_type=mask_type, window=window)
        cfg = config(case)
        mt = AttnMaskType[mask_type]
        ours = TorchDotProductAttention(cfg, 1, mt, "self")
        # Megatron's per document (causal types: its default causal mask; no_mask: none)
        dense_type = AttnMaskType.causal if "causal" in mask_type else AttnMaskType.no_mask
        ref = DotProductAttention(cfg, 1, dense_type, "self")
        g = torch.Generator().manual_seed(3)
        docs = [[torch.randn(n, 1, h, 16, generator=g) for h in (8, groups, groups)] for n in lengths]
        # the pack: documents back to back, `pad` padding tokens after each (padded offsets)
        zeros = lambda h: torch.zeros(pad, h, 16)  # noqa: E731
        packed = [torch.cat([x for d in docs for x in (d[i][:, 0], zeros(d[i].shape[2]))]).requires_grad_()
                  for i in range(3)]
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        cu_pad = torch.tensor([0] + [n + pad for n in lengths]).cumsum(0).to(torch.int32)
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 cu_seqlens_q_padded=cu_pad if pad else None,
                                 cu_seqlens_kv_padded=cu_pad if pad else None,
                                 max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
        got = run(ours, *packed, None, packed_seq_params=params)
        # each document alone, through Megatron's attention and ours, same output gradient rows
        dy = torch.randn(got[0].shape, generator=torch.Generator().manual_seed(7))
        errs = {"ours_alone": 0.0, "megatron_alone": 0.0}
        for i, (d, n) in enumerate(zip(docs, lengths)):
            rows = slice(int(cu_pad[i]), int(cu_pad[i]) + n)
            for label, module in (("ours_alone", TorchDotProductAttention(cfg, 1, dense_type, "self")),
                                  ("megatron_alone", ref)):
                if label == "megatron_alone" and window is not None:
                    continue  # Megatron's windowed mask is compared densely (test_equals_...)
                x = [t.clone().requires_grad_() for t in d]
                y = module(*x, None) if label == "ours_alone" else _megatron(module, x)
                y.backward(dy[rows].reshape(y.shape))
                for a, b in ((y.detach().reshape(n, -1), got[0][rows]),) + tuple(
                        (t.grad[:, 0], grad[rows]) for t, grad in zip(x, got[1:])):
                    errs[label] = max(errs[label], rel(b, a))
        out[name] = errs
    return out


def _megatron(module, x):
    from helpers.megatron_cpu import cuda_tensors_on_cpu

    with cuda_tensors_on_cpu():
        return module(*x, None)


@pytest.fixture(scope="module")
def packed():
    return dist.run(_packed, 1, timeout=300)[0]


@pytest.mark.parametrize("name", ["causal_gqa", "padding_causal_mqa", "no_mask", "causal_window",
                                  "causal_padded_apart"])
def test_packed_sequences_equal_each_document_alone(packed, name):
    errs = packed[name]
    assert errs["ours_alone"] <= TOL and errs["megatron_alone"] <= TOL, errs


def _packed_refusals(rank, world):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from helpers.attention import Case, config
    from helpers.megatron_cpu import init
    from megatron_overlap.attention import TorchDotProductAttention

    init(world)
    cfg = config(Case("x"))
    q = torch.randn(10, 8, 16)
    cu, cu_pad = torch.tensor([0, 4, 10], dtype=torch.int32), torch.tensor([0, 5, 10], dtype=torch.int32)
    said = {}
    for what, mt, params, mask, bias in (
            ("padded_no_mask", "no_mask", dict(cu_seqlens_q_padded=cu_pad, cu_seqlens_kv_padded=cu_pad), None, None),
            ("sbhd", "causal", dict(qkv_format="sbhd"), None, None),
            ("mask_beside_pack", "causal", {}, torch.zeros(1, 1, 10, 10, dtype=torch.bool), None),
            ("attention_bias", "causal", None, None, torch.zeros(1, 8, 10, 10))):
        module = TorchDotProductAttention(cfg, 2, AttnMaskType[mt], "self")
        p = None if params is None else PackedSeqParams(**{"qkv_format": "thd", "cu_seqlens_q": cu,
                                                          "cu_seqlens_kv": cu, "max_seqlen_q": 6,
                                                          "max_seqlen_kv": 6, **params})
        try:
            module(q, q, q, mask, attention_bias=bias, packed_seq_params=p)
            said[what] = None
        except ValueError as e:
            said[what] = str(e)
    return said


def test_what_it_cannot_take_at_forward_is_a_clear_error_naming_the_layer():
    said = dist.run(_packed_refusals, 1, timeout=120)[0]
    for what, message in said.items():
        assert message is not None and message.startswith("layer 2 core attention:"), (what, message)
    assert "causal" in said["padded_no_mask"] and "'thd'" in said["sbhd"]
    assert "attention_bias" in said["attention_bias"]


# -- dropout ---------------------------------------------------------------------------------
def _dropout(rank, world, sequence_parallel):
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.enums import AttnMaskType

    from helpers.attention import Case, config, inputs
    from helpers.megatron_cpu import init
    from megatron_overlap.attention import TorchDotProductAttention

    init(world)
    case = Case("dropout", groups=2)
    cfg = config(case, tp=world, attention_dropout=0.3, sequence_parallel=sequence_parallel)
    module = TorchDotProductAttention(cfg, 1, AttnMaskType.causal, "self")
    q, k, v, _ = inputs(case, torch.float32, "cpu", tp=world)  # the same inputs on every rank

    def seeded():
        torch.manual_seed(11)
        mrandom.get_cuda_rng_tracker().reset()
        mrandom.get_cuda_rng_tracker().add("model-parallel-rng", 11 + 100 * rank)  # per TP rank
        return module(q, k, v, None).detach()
    first, second = seeded(), seeded()
    module.eval()
    evaluated = module(q, k, v, None).detach()
    module.dropout_p = 0.0
    module.train()
    plain = module(q, k, v, None).detach()
    return first, second, evaluated, plain


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_dropout_is_reproducible_forked_per_tp_rank_and_off_in_eval(sequence_parallel):
    per_rank = dist.run(_dropout, 2, sequence_parallel, timeout=200)
    for first, second, evaluated, plain in per_rank:
        assert torch.equal(first, second)  # one seed, one result
        assert not torch.allclose(first, plain)  # dropout did act in training
        assert torch.equal(evaluated, plain)  # and not in eval
    same_inputs_same_masks = torch.equal(per_rank[0][0], per_rank[1][0])
    # without SP Megatron forks its TP-rank RNG (different masks per rank); with SP it
    # draws from the default generator, seeded alike on every rank
    assert same_inputs_same_masks == sequence_parallel


def _recompute(rank, world):
    """SelfAttention with selective recompute of core attention against the same layer
    without it, dropout on: the recomputed forward draws the same dropout mask, so the
    grads are equal."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer.transformer_layer import TransformerLayer

    import megatron_overlap as mo
    from helpers.attention import Case, config
    from helpers.megatron_cpu import init, rng_states_on_cpu

    init(world)
    rng_states_on_cpu()
    results = {}
    mo.install()
    try:
        for recompute in (False, True):
            extra = dict(recompute_granularity="selective", recompute_modules=["core_attn"]) if recompute else {}
            cfg = config(Case("r", groups=2), attention_dropout=0.3, hidden_dropout=0.0, **extra)
            torch.manual_seed(5)
            spec = get_gpt_layer_local_spec()
            layer = TransformerLayer(cfg, spec.submodules, layer_number=1)
            x = torch.randn(12, 2, 64, generator=torch.Generator().manual_seed(1)).requires_grad_()
            torch.manual_seed(9)
            mrandom.get_cuda_rng_tracker().reset()
            mrandom.get_cuda_rng_tracker().add("model-parallel-rng", 21)
            y, _ = layer(x, attention_mask=None)
            y.backward(torch.ones_like(y))
            results[recompute] = (type(layer.self_attention.core_attention).__name__,
                                  layer.self_attention.checkpoint_core_attention, y.detach(),
                                  x.grad.clone(), [p.grad.clone() for p in layer.parameters()])
    finally:
        mo.uninstall()
    return results


def test_selective_recompute_of_core_attention_reproduces_dropout():
    r = dist.run(_recompute, 1, timeout=200)[0]
    (name0, ck0, y0, dx0, g0), (name1, ck1, y1, dx1, g1) = r[False], r[True]
    assert name0 == name1 == "TorchDotProductAttention" and (ck0, ck1) == (False, True)
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))


# -- a model ---------------------------------------------------------------------------------
def _gpt(rank, world, ckpt_dir):
    import megatron_overlap as mo
    from helpers.gpt import checkpoint_both_ways, make_config, make_model, train
    from helpers.megatron_cpu import init
    from megatron_overlap.telemetry import attention_settings

    init(world)
    built = {}
    for attention in ("megatron", "torch"):
        mo.install(attention=attention)
        try:
            built[attention] = [make_model(make_config(world, "swiglu_gqa_rms", overlap=True)) for _ in range(2)]
        finally:
            mo.uninstall()
    (plain, wrap_plain), (fresh_plain, _) = built["megatron"]
    (ours, wrap_ours), (fresh_ours, _) = built["torch"]
    ours.load_state_dict(plain.state_dict())
    rows = {a: attention_settings(m) for a, m in (("megatron", plain), ("torch", ours))}
    losses = (train(wrap_plain(plain)), train(wrap_ours(ours)))
    param_err = max(rel(p, q) for p, q in zip(ours.parameters(), plain.parameters()))
    ckpt = checkpoint_both_ways(rank, ckpt_dir, ours, plain, fresh_ours, fresh_plain, tag="attn_")
    return rows, losses, param_err, ckpt


def test_a_gpt_model_trains_as_on_megatrons_attention_and_checkpoints_move(tmp_path):
    for rows, (plain, ours), param_err, ckpt in dist.run(_gpt, 2, str(tmp_path), timeout=400):
        assert [r["impl"] for r in rows["torch"]] == ["torch", "torch"]
        assert [r["impl"] for r in rows["megatron"]] == ["megatron", "megatron"]
        assert all("install(attention='megatron')" in r["reason"] for r in rows["megatron"])
        assert ours == pytest.approx(plain, rel=TOL) and param_err <= TOL
        assert ckpt == {"ours_to_plain": 0.0, "plain_to_ours": 0.0}


# -- what runs where -------------------------------------------------------------------------
def _choices(rank, world):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnBackend, AttnMaskType

    import megatron_overlap as mo
    from helpers.attention import Case, config
    from helpers.megatron_cpu import init
    from megatron_overlap.attention import TorchDotProductAttention

    init(world)
    cfg = lambda **kw: config(Case("c", groups=2), **kw)  # noqa: E731

    def built(**kw):
        m = DotProductAttention(cfg(**kw), 1, AttnMaskType.causal, "self")
        return type(m).__name__, getattr(m, "megatron_overlap_attention", None)
    out = {"not installed": built()}
    mo.install()
    try:
        out["installed"] = built()
        out["softmax learnable"] = built(softmax_type="learnable")
        out["qk_clip"] = built(qk_clip=True)
        out["backend unfused"] = built(attention_backend=AttnBackend.unfused)
        out["backend flash"] = built(attention_backend=AttnBackend.flash)
        mo.install(attention="megatron")
        out["install(attention='megatron')"] = built()
        mo.uninstall()
        out["back to torch"] = built()
        try:
            mo.install(attention="flash")
        except ValueError as e:
            out["bad choice"] = str(e)
    finally:
        mo.uninstall()
    out["uninstalled"] = built()
    spec = mo.overlap_layer_spec(get_gpt_layer_local_spec())
    out["overlap_layer_spec"] = spec.submodules.self_attention.submodules.core_attention.__name__
    kept = mo.overlap_layer_spec(get_gpt_layer_local_spec(), attention="megatron")
    out["overlap_layer_spec megatron"] = kept.submodules.self_attention.submodules.core_attention.__name__
    # MLA's core attention gets k_channels / v_channels, which Megatron's class has no slot for
    mla = TorchDotProductAttention(cfg(), 1, AttnMaskType.causal, "self", k_channels=24, v_channels=16,
                                   softmax_scale=0.2)
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(10, 2, 8, 24, generator=g), torch.randn(10, 2, 2, 24, generator=g)
    v = torch.randn(10, 2, 2, 16, generator=g)
    got = mla(q, k, v, None)
    # fp64 reference: softmax(q k^T * scale, causal) v, groups shared by 4 heads each
    qd, kd, vd = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))
    kd, vd = kd.repeat_interleave(4, 1), vd.repeat_interleave(4, 1)
    s = qd @ kd.transpose(-1, -2) * 0.2
    s = s.masked_fill(torch.ones(10, 10, dtype=torch.bool).triu(1), float("-inf"))
    want = (s.softmax(-1) @ vd).permute(2, 0, 1, 3).reshape(10, 2, -1)
    out["mla"] = (tuple(got.shape), rel(got, want))
    return out


def test_install_chooses_the_attention_and_keeps_megatrons_where_it_must():
    out = dist.run(_choices, 1, timeout=200)[0]
    assert out["not installed"] == ("DotProductAttention", None)
    assert out["installed"] == ("TorchDotProductAttention", None)
    assert out["back to torch"] == ("TorchDotProductAttention", None)
    assert out["backend flash"] == ("TorchDotProductAttention", None)
    for key, words in (("softmax learnable", "softmax_type='learnable'"), ("qk_clip", "qk_clip"),
                       ("backend unfused", "attention_backend=unfused"),
                       ("install(attention='megatron')", "install(attention='megatron')")):
        name, why = out[key]
        assert name == "DotProductAttention" and words in why, (key, out[key])
    assert "attention must be one of ('torch', 'megatron')" in out["bad choice"]
    assert out["uninstalled"] == ("DotProductAttention", None)
    assert out["overlap_layer_spec"] == "TorchDotProductAttention"
    assert out["overlap_layer_spec megatron"] == "DotProductAttention"
    shape, err = out["mla"]
    assert shape == (10, 2, 8 * 16) and err <= TOL


def _refusals(rank, world):
    """What neither attention can run is refused when the layer is built, naming it."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    import megatron_overlap as mo
    from helpers.attention import Case, config
    from helpers.megatron_cpu import init

    init(world)
    said = {}
    mo.install()
    try:
        for what, extra, kw in (("context parallelism", {}, {}),
                                ("MLA with sinks", {"softmax_type": "learnable"},
                                 {"k_channels": 24, "v_channels": 16})):
            cfg = config(Case("x", groups=2), **extra)
            if what == "context parallelism":  # as a config with CP reaches the core attention
                cfg.context_parallel_size = 2
            try:
                DotProductAttention(cfg, 3, AttnMaskType.causal, "self", **kw)
                said[what] = None
            except ValueError as e:
                said[what] = str(e)
    finally:
        mo.uninstall()
    return said


def test_what_neither_attention_can_run_is_refused_when_built():
    said = dist.run(_refusals, 1, timeout=120)[0]
    cp, mla = said["context parallelism"], said["MLA with sinks"]
    assert cp and cp.startswith("core attention of layer 3: context parallelism") and \
        "asserts context_parallel_size == 1" in cp and "TEDotProductAttention" in cp, cp
    assert mla and "softmax_type='learnable'" in mla and "k_channels / v_channels" in mla, mla


def test_the_report_folds_layers_that_share_a_setting():
    from megatron_overlap.telemetry import attention_table

    rows = [{"layer_number": n, "module": f"decoder.layers.{n}.self_attention.core_attention",
             "impl": "torch", "mask": "causal", "window": None, "heads": "8:2", "dropout": 0.0,
             "ran": "sdpa", "reason": ""} for n in (0, 1, 2, 5)]
    rows.append({**rows[0], "layer_number": 3, "impl": "megatron", "ran": "unfused",
                 "reason": "softmax_type='learnable' (a softmax offset / attention sinks)"})
    text = attention_table(rows)
    assert "Core attention: 5 layers" in text
    lines = [line for line in text.splitlines() if "causal" in line]
    assert len(lines) == 2, text
    assert lines[0].split()[:3] == ["0-2,5", "torch", "(fused)"], lines[0]
    assert "Megatron's unfused" in lines[1] and "learnable" in text
