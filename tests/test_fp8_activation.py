"""The SwiGLU fused with the FP8 casts around it (overlap/fp8_act.py, layers/fp8_act.py,
megatron/mlp.py): its casts against the reference's quantization of the SwiGLU computed in
float32 (bit-equal: the same float32 terms, the same cast), rows chunk-major and the
transposed copy included; a Megatron MLP of our FP8 linears (TP 2, SP on and off) against
the independent FP8 reference of the whole MLP (helpers/fp8_ref.py: each GEMM one
whole-tensor `_scaled_mm`), its fc2 input and fc1 output gradient the FP8 tensors the
reference makes, bit for bit; and against the same MLP with Megatron's SwiGLU
(`install(fp8_fused_activation=False)`), tensorwise and delayed; what is not fused, and why."""

import pytest
import torch

from helpers import dist
from helpers import fp8_ref as ref

SEQ, BATCH, H, F = 16, 2, 32, 64


def swiglu_ref(y: torch.Tensor) -> torch.Tensor:
    gate, up = y.float().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def swiglu_grad_ref(g: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    gate, up = y.float().chunk(2, dim=-1)
    s, g = torch.sigmoid(gate), g.float()
    return torch.cat((g * s * (1 + gate * (1 - s)) * up, g * (gate * s)), dim=-1)


# (fc1's output gradient is never cast chunk-major: fc2's input is, for its pipeline)
@pytest.mark.parametrize("act,chunks", [("swiglu", None), ("swiglu", (2, 2)),
                                        ("swiglu_grad", None)],
                         ids=["swiglu", "swiglu_chunk_major", "swiglu_grad"])
@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
def test_the_fused_cast_is_the_float32_swiglu_quantized(act, chunks, delayed):
    from megatron_overlap.overlap import fp8
    from megatron_overlap.overlap.fp8_act import quantized

    gen = torch.Generator().manual_seed(3)
    y = (torch.randn(32, 2 * F, generator=gen) * 3).bfloat16()
    g = torch.randn(32, F, generator=gen).bfloat16() if act == "swiglu_grad" else None
    x = swiglu_ref(y) if g is None else swiglu_grad_ref(g, y)
    dtype = ref.E4M3 if g is None else ref.E5M2
    out = torch.empty(x.shape, dtype=dtype)
    out_t = torch.empty(x.shape[::-1], dtype=dtype)
    pair, amax = fp8.scale_pair("cpu"), torch.empty((), dtype=torch.float32)
    state = None
    if delayed:
        state = fp8.AmaxHistory(4, torch.device("cpu"))
        state.scale.copy_(fp8.pair_of(torch.tensor(8.0)))
    quantized(act, y, g, dtype, pair, out, out_t, chunks, state, amax)
    want, s = ref.quantize(x, dtype, torch.tensor(8.0) if delayed else None)
    rows = out if chunks is None else fp8.chunk_major(out, chunks[1], chunks[0])
    assert torch.equal(rows.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(out_t.view(torch.uint8), want.t().contiguous().view(torch.uint8))
    assert fp8.scale_value(pair).item() == s.item()
    assert amax.item() == x.abs().max().item()


def test_an_fp8_activation_reads_as_its_values_anywhere_else():
    from megatron_overlap.layers.fp8_act import Fp8Activation
    from megatron_overlap.overlap import fp8

    x = torch.randn(8, 2, 16).bfloat16()
    x8, s = ref.quantize(x.reshape(16, 16), ref.E4M3)
    rows = fp8.chunk_major(x8, 2, 2)
    a = Fp8Activation(rows, None, fp8.pair_of(s), None, (2, 2), x.shape, x.dtype)
    assert a.shape == x.shape and a.dtype == torch.bfloat16
    want = ref.dequantize(x8, s, torch.bfloat16).view(x.shape)
    assert torch.equal(a + 0, want)  # an op of its own: the values, rows back in order
    assert torch.equal(a.dequantized(), want)


def _mlp(fused: bool, sp: bool, recipe: str, world: int, install: dict | None = None, **cfg):
    import torch.nn.functional as F_

    import megatron_overlap as mo
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLP, MLPSubmodules

    mo.install(backend="torch_p2p", fp8_fused_activation=fused, **(install or {}))
    try:
        extra = (dict(fp8_amax_history_len=4, fp8_amax_compute_algo="max",
                      tp_only_amax_red=True) if recipe == "delayed" else {})
        extra.update(cfg)
        cfg = TransformerConfig(num_layers=1, hidden_size=H, ffn_hidden_size=F,
                                num_attention_heads=4, tensor_model_parallel_size=world,
                                sequence_parallel=sp, tp_comm_overlap=True,
                                use_cpu_initialization=True, params_dtype=torch.bfloat16,
                                bf16=True, **{**dict(gated_linear_unit=True,
                                                     activation_func=F_.silu,
                                                     add_bias_linear=False,
                                                     bias_activation_fusion=fused,
                                                     fp8="hybrid", fp8_recipe=recipe),
                                              **extra})
        return MLP(cfg, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                      linear_fc2=RowParallelLinear))
    finally:
        mo.uninstall()


def _mlp_run(rank, world, sp, recipe):
    from helpers.megatron_cpu import init
    from megatron_overlap.layers.fp8_act import Fp8Activation
    from megatron_overlap.megatron.mlp import OverlapMLP

    from megatron_overlap.layers import functions

    init(world)
    given, original = [], functions._given_grad

    def spy(grad_out, *args):  # what fc1's backward is handed: FP8 from the SwiGLU, or not
        given.append(type(grad_out).__name__)
        return original(grad_out, *args)
    functions._given_grad = spy
    gen = torch.Generator().manual_seed(7)
    X = torch.randn(SEQ, BATCH, H, generator=gen).bfloat16()
    W1 = (torch.randn(2 * F, H, generator=gen) / H ** 0.5).bfloat16()
    W2 = (torch.randn(H, F, generator=gen) / F ** 0.5).bfloat16()
    G = torch.randn(SEQ, BATCH, H, generator=gen).bfloat16()
    rows1, cols2 = 2 * F // world, F // world
    seq = SEQ // world if sp else SEQ
    mine_rows = slice(rank * seq, (rank + 1) * seq) if sp else slice(None)  # (no SP: all)
    out = {}
    for fused in (True, False):
        mlp = _mlp(fused, sp, recipe, world)
        seen = []
        mlp.linear_fc2.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
        with torch.no_grad():
            mlp.linear_fc1.weight.copy_(W1[rank * rows1:(rank + 1) * rows1])
            mlp.linear_fc2.weight.copy_(W2[:, rank * cols2:(rank + 1) * cols2])
        steps = []
        for _ in range(3 if recipe == "delayed" else 1):
            x = X[mine_rows].clone().requires_grad_(True)
            y, _ = mlp(x)
            y.backward(G[mine_rows])
            steps.append(dict(y=y.detach(), dx=x.grad, dw1=mlp.linear_fc1.weight.grad.clone(),
                              dw2=mlp.linear_fc2.weight.grad.clone()))
            mlp.zero_grad()
        a = seen[0]
        histories = ({} if recipe != "delayed" else
                     {(fc, role): getattr(mlp, fc)._fp8_delayed.get(role, "cpu").history.clone()
                      for fc, role in (("linear_fc2", "input"), ("linear_fc1", "grad"))})
        out[fused] = dict(cls=type(mlp).__name__, fused=isinstance(mlp, OverlapMLP),
                          carrier=isinstance(a, Fp8Activation), steps=steps,
                          a=a.dequantized() if isinstance(a, Fp8Activation) else None,
                          fc1_given=list(given), histories=histories)
        given.clear()
    # the reference, from the whole tensors (tensorwise: each amax the whole tensor's,
    # or the shard's for a rank's own weight and activation)
    t = SEQ * BATCH
    x8, sx = ref.quantize(X.reshape(t, H), ref.E4M3)
    g8, sg = ref.quantize(G.reshape(t, H), ref.E5M2)
    parts, dx_parts, mine = [], [], {}
    for r in range(world):
        w1_8, sw1 = ref.quantize(W1[r * rows1:(r + 1) * rows1], ref.E4M3)
        w2_8, sw2 = ref.quantize(W2[:, r * cols2:(r + 1) * cols2], ref.E4M3)
        y1 = ref.mm(x8, sx, w1_8.t(), sw1, torch.bfloat16)
        a8, sa = ref.quantize(swiglu_ref(y1), ref.E4M3)
        parts.append(ref.mm(a8, sa, w2_8.t(), sw2, torch.bfloat16).double())
        da = ref.mm(g8, sg, w2_8, sw2, torch.bfloat16)
        d8, sd = ref.quantize(swiglu_grad_ref(da, y1), ref.E5M2)
        dx_parts.append(ref.mm(d8, sd, w1_8, sw1, torch.bfloat16).double())
        if r == rank:
            mine = dict(a=ref.dequantize(a8, sa, torch.bfloat16).view(SEQ, BATCH, -1),
                        dw1=ref.mm(d8.t(), sd, x8, sx, torch.bfloat16),
                        dw2=ref.mm(g8.t(), sg, a8, sa, torch.bfloat16))
    block = slice(rank * seq * BATCH, (rank + 1) * seq * BATCH) if sp else slice(None)
    mine["y"] = sum(parts)[block].view(seq, BATCH, H)
    mine["dx"] = sum(dx_parts)[block].view(seq, BATCH, H)
    return dict(out=out, ref=mine)


@pytest.fixture(scope="module", params=[(True, "tensorwise"), (False, "tensorwise"),
                                        (True, "delayed")], ids=["sp", "no_sp", "sp_delayed"])
def mlp_runs(request):
    sp, recipe = request.param
    return recipe, dist.run(_mlp_run, 2, sp, recipe, timeout=300)


def test_an_fp8_mlp_with_its_swiglu_fused_is_the_reference_mlp(mlp_runs):
    recipe, ranks = mlp_runs
    for r in ranks:
        fused, plain = r["out"][True], r["out"][False]
        assert fused["cls"] == "OverlapMLP" and fused["carrier"], fused["cls"]
        assert plain["cls"] == "MLP" and not plain["carrier"]
        # fc1's backward is handed the SwiGLU's FP8 gradient, at every step (not cast again)
        steps = len(fused["steps"])
        assert fused["fc1_given"] == ["Fp8Activation"] * steps, fused["fc1_given"]
        assert plain["fc1_given"] == ["Tensor"] * steps
        # delayed scaling: the amaxes the fused kernels recorded (fc2's input, fc1's output
        # gradient, the TP group's max) are Megatron's SwiGLU's but for its rounding to bf16
        for key, h in fused["histories"].items():
            want = plain["histories"][key]
            assert (h[-steps:] > 0).all() and (h[:-steps] == 0).all(), (key, h)
            assert ref.rel(h.double(), want.double()) < 1e-2, (key, h, want)
        if recipe == "tensorwise":  # the reference's scales are current scaling's
            assert torch.equal(fused["a"], r["ref"]["a"])  # fc2's FP8 input, bit for bit
            for k in ("y", "dx", "dw1", "dw2"):
                got, want = fused["steps"][0][k].double(), r["ref"][k].double()
                # the reduce-scatter sums bf16 partial products (the reference in float64)
                assert ref.rel(got, want) < 1e-2, (k, ref.rel(got, want))
        # Megatron's SwiGLU rounds to bf16 before fc2's cast, and its backward before fc1's:
        # the same MLP within FP8's rounding of that (a wrong scale or layout is off by > 0.5)
        for s_f, s_p in zip(fused["steps"], plain["steps"]):
            for k in ("y", "dx", "dw1", "dw2"):
                err = ref.rel(s_f[k].double(), s_p[k].double())
                assert err < 0.1, (recipe, k, err)


def _not_fused(rank, world):
    import torch.nn.functional as F_

    from helpers.megatron_cpu import init
    from megatron_overlap.megatron.mlp import why_not_fused

    init(world)
    cases = {"bias": dict(add_bias_linear=True), "gelu": dict(activation_func=F_.gelu),
             "fp8_wgrad off": dict(fp8_wgrad=False), "clamp": dict(activation_func_clamp_value=5.0),
             "clamp 0": dict(activation_func_clamp_value=0.0),
             "offset": dict(glu_linear_offset=1.0, bias_activation_fusion=False),
             "fp8_input_store": dict(activation_func_fp8_input_store=True)}
    out = {k: (type(m).__name__, why_not_fused(m)) for k, m in (
        (k, _mlp(True, True, "tensorwise", world, **c)) for k, c in cases.items())}
    rowwise = _mlp(True, True, "tensorwise", world, install=dict(fp8_scaling="rowwise"),
                   fp8_wgrad=False)
    out["rowwise"] = (type(rowwise).__name__, why_not_fused(rowwise))
    off = _mlp(False, True, "tensorwise", world)
    out["install off"] = (type(off).__name__, why_not_fused(off))  # (it could run fused)
    return out


def test_an_mlp_the_fused_kernel_cannot_run_keeps_megatrons_swiglu_and_says_why():
    got = dist.run(_not_fused, 2, timeout=300)[0]
    want = {"bias": "fc1 has a bias", "gelu": "not a SwiGLU", "fp8_wgrad off": "FP8 wgrad",
            "clamp": "activation_func_clamp_value", "clamp 0": "activation_func_clamp_value",
            "offset": "glu_linear_offset", "fp8_input_store": "activation_func_fp8_input_store",
            "rowwise": "per-tensor scales"}
    for case, words in want.items():
        cls, why = got[case]
        assert cls == "MLP" and why is not None and words in why, (case, why)
    assert got["install off"] == ("MLP", None)


def test_install_refuses_a_fused_activation_setting_that_is_not_a_bool():
    import megatron_overlap as mo
    from megatron_overlap.config import state

    with pytest.raises(ValueError, match="fp8_fused_activation must be True or False, not 'no'"):
        mo.install(fp8_fused_activation="no")
    assert not state.installed()  # refused before anything was set
