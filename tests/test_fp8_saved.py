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

And with fp8_wgrad off, the input is kept in the parameters' dtype (the wgrad's own)."""

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
