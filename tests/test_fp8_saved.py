"""What an FP8 layer's forward keeps for its backward (tensorwise, fp8_wgrad on), and in
which layout: one FP8 copy of its input and one of its weight, no more than the tensors
the backward's GEMMs read, laid out as they read them where the cast could write that
layout (layers/fp8.py: the cast writes the transposed copy too):

- the weight's FP8 copy transposed ([in, out], contiguous: the dgrad's column-major
  operand), at every forward and in the weight cache alike;
- a row layer's input, and a column layer's input without sequence parallelism (the
  wgrad reads it ungathered), column-major FP8 [tokens, in] (the wgrad's column-major
  operand): nothing left to transpose in the backward;
- a column layer's input under sequence parallelism, row-major FP8 [tokens / TP, in]:
  the backward gathers it (row-major, as the transport moves rows) and transposes the
  gathered tensor.

And with fp8_wgrad off, the input is kept in the parameters' dtype (the wgrad's own). A
frozen weight's layer keeps no input; at a step's later micro-batch the kept FP8 weight is
the cache's; a forward without autograd casts the input in one layout only, and an
uncached weight too (the casts' calls, counted)."""

import pytest

from helpers import dist

K, N, SEQ, BATCH = 64, 96, 16, 2


def _kept(rank, world):
    import torch

    import megatron_overlap as mo
    from helpers.fp8_layers import config
    from helpers.megatron_cpu import init
    from megatron_overlap.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear

    init(world)
    out = {}
    for kind in ("column", "row"):
        for sp in (True, False):
            for wgrad in (True, False):
                mo.install(backend="torch_p2p")
                try:
                    cfg = config(world, sp, torch.float32, {}, fp8="hybrid",
                                 fp8_recipe="tensorwise", fp8_wgrad=wgrad)
                    layer = (OverlapColumnParallelLinear(
                        K, N, config=cfg, init_method=torch.nn.init.normal_, bias=False,
                        gather_output=False, tp_comm_buffer_name="qkv") if kind == "column" else
                        OverlapRowParallelLinear(
                            N, K, config=cfg, init_method=torch.nn.init.normal_, bias=False,
                            input_is_parallel=True, skip_bias_add=True,
                            tp_comm_buffer_name="proj"))
                finally:
                    mo.uninstall()
                seq = SEQ // world if kind == "column" and sp else SEQ
                x = torch.randn(seq, BATCH, K if kind == "column" else N // world,
                                requires_grad=True)
                kept = []

                def pack(t):
                    kept.append((str(t.dtype), tuple(t.shape), tuple(t.stride()),
                                 t is layer.weight))
                    return t
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    y, _ = layer(x)
                y.sum().backward()  # the backward runs on what was kept
                out[(kind, sp, wgrad)] = dict(kept=kept, x=(tuple(x.shape)),
                                              w=tuple(layer.weight.shape))
    return out


@pytest.fixture(scope="module")
def kept():
    return dist.run(_kept, 2, timeout=300)[0]


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no_sp"])
@pytest.mark.parametrize("wgrad", [True, False], ids=["fp8_wgrad", "bf16_wgrad"])
def test_the_fp8_forward_keeps_one_copy_of_each_operand_in_the_layout_it_is_read(
        kept, kind, sp, wgrad):
    r = kept[(kind, sp, wgrad)]
    e4m3, fp32 = "torch.float8_e4m3fn", "torch.float32"
    tokens = r["x"][0] * r["x"][1]
    k = r["x"][2]
    n = r["w"][0]
    fp8 = [(d, s, st) for d, s, st, is_w in r["kept"] if d.startswith("torch.float8")]
    params = [x for x in r["kept"] if x[3]]
    assert len(params) == 1, r  # the weight itself (a parameter: no memory)
    assert (e4m3, (k, n), (n, 1)) in fp8, r  # the FP8 weight, transposed (the dgrad's)
    if not wgrad:
        assert fp8 == [(e4m3, (k, n), (n, 1))], r
        assert [x for x in r["kept"] if x[0] == fp32 and x[1] == r["x"]], r  # the input as given
        return
    if kind == "column" and sp:  # gathered in the backward: row-major, this rank's rows
        want = (e4m3, (tokens, k), (k, 1))
    else:  # read by the wgrad as it is: column-major, written so by its cast
        want = (e4m3, (tokens, k), (1, tokens))
    assert sorted(fp8) == sorted([(e4m3, (k, n), (n, 1)), want]), r
    assert not [x for x in r["kept"] if x[0] == fp32 and not x[3] and len(x[1]) > 1], r


def _others(rank, world):
    import torch

    import megatron_overlap as mo
    from helpers.fp8_layers import config
    from helpers.megatron_cpu import init
    from megatron_overlap.layers import OverlapRowParallelLinear
    from megatron_overlap.layers import fp8 as lf

    init(world)
    out = {}
    mo.install(backend="torch_p2p")
    try:
        layers = {cache: OverlapRowParallelLinear(
            N, K, config=config(world, True, torch.float32, {}, fp8="hybrid",
                                fp8_recipe="tensorwise",
                                disable_parameter_transpose_cache=not cache),
            init_method=torch.nn.init.normal_, bias=False, input_is_parallel=True,
            skip_bias_add=True, tp_comm_buffer_name="proj") for cache in (True, False)}
    finally:
        mo.uninstall()
    x = torch.randn(SEQ, BATCH, N // world, requires_grad=True)

    def run(layer, first=None, grad=True):
        kept, casts, real = [], [], lf.quantize_current  # (tensorwise's casts)

        def pack(t):
            kept.append(t)
            return t

        def counting(t, *a, out_t=None, **k):
            casts.append((tuple(t.shape), out_t is not None))
            return real(t, *a, out_t=out_t, **k)
        if first is not None:
            layer.is_first_microbatch = first
        lf.quantize_current = counting
        try:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                    torch.set_grad_enabled(grad):
                y, _ = layer(x)
        finally:
            lf.quantize_current = real
        if grad:
            y.sum().backward()
        return kept, casts

    cached = layers[True]
    for first in (True, True):  # a schedule seen driving the flag: the cache in use
        run(cached, first)
    kept, _ = run(cached, False)  # a later micro-batch: the cache's transposed weight kept
    cache = cached._fp8_cache
    out["later_kept_cache_w8t"] = any(t is cache.w8t for t in kept)
    _, casts = run(layers[False], grad=False)
    out["no_grad_casts"] = casts  # (shape, with a transposed copy) per cast
    layers[False].weight.requires_grad_(False)
    kept, _ = run(layers[False])
    out["frozen_kept"] = [(str(t.dtype), tuple(t.shape)) for t in kept
                          if t is not layers[False].weight]
    return out


def test_what_a_later_micro_batch_a_forward_without_autograd_and_a_frozen_weight_keep():
    r = dist.run(_others, 2, timeout=300)[0]
    assert r["later_kept_cache_w8t"], r
    tokens, k = SEQ * BATCH, N // 2
    # the input and the weight, each cast once, neither with a transposed copy
    assert sorted(r["no_grad_casts"]) == sorted([((tokens, k), False), ((K, k), False)]), r
    # a frozen weight: no input kept, only the FP8 weight transposed (for the dgrad) and scales
    assert [s for d, s in r["frozen_kept"] if len(s) > 1] == [(k, K)], r
    assert all(d.startswith("torch.float8") for d, s in r["frozen_kept"] if len(s) > 1), r


def _recompute(rank, world):
    import torch

    import megatron_overlap as mo
    from helpers.gpt import make_config, make_model, train
    from helpers.megatron_cpu import init, rng_states_on_cpu

    init(world)
    rng_states_on_cpu()  # Megatron's checkpoint saves a CUDA generator's state too
    fp8 = dict(fp8="hybrid", fp8_recipe="tensorwise")
    ways = {"full": dict(recompute_granularity="full", recompute_method="uniform",
                         recompute_num_layers=1),
            "selective_mlp": dict(recompute_granularity="selective", recompute_modules=["mlp"])}
    out = {}
    mo.install()  # trained while installed: the checkpoint is install()'s while it is
    try:
        plain, wrap_plain = make_model(make_config(world, "swiglu_gqa_rms", overlap=True, **fp8))
        models = {"plain": (plain, wrap_plain)}
        for name, how in ways.items():
            try:
                models[name] = make_model(make_config(world, "swiglu_gqa_rms", overlap=True,
                                                      **fp8, **how))
            except TypeError as exc:  # recompute_modules: megatron-core 0.15 on
                out[name] = f"not in this megatron-core: {exc}"
        start = {k: v.clone() if isinstance(v, torch.Tensor) else v
                 for k, v in plain.state_dict().items()}
        for name, (model, wrap) in models.items():
            model.load_state_dict(start)  # every model from the same weights
            out[name] = train(wrap(model), steps=3, schedule=True, microbatches=2)
    finally:
        mo.uninstall()
    import megatron.core.transformer.transformer_block as block

    out["restored"] = block.te_checkpoint is None  # (no TE here: megatron-core's None)
    return out


def test_fp8_training_under_activation_recompute_equals_it_without():
    """megatron-core checkpoints an FP8 model with Transformer Engine's te_checkpoint, which
    without TE is None or raises: install() makes it Megatron's own checkpoint. Full
    recompute runs each layer's forward twice, the first without autograd (no layout for a
    backward written, the FP8 weight cache made at a step's first micro-batch); selective
    recompute the MLP's: the losses are those of the same FP8 model without recompute, bit
    for bit."""
    for r in dist.run(_recompute, 2, timeout=300):
        assert r["full"] == r["plain"], r
        assert r["selective_mlp"] == r["plain"] or r["selective_mlp"].startswith("not in"), r
        assert r["restored"], r
