"""The core attention on a GPU (megatron_overlap.attention), where torch's fused kernels
run (flash, cuDNN, memory-efficient; varlen flash for packed sequences and windows):
bf16 and fp16 within their tolerance of Megatron's DotProductAttention (its unfused path,
masked_softmax_fusion off, which is the one that honours windows), and no less accurate
than Megatron's own bf16 path against fp32; sliding windows (Megatron's mask is made on
CUDA); head dim 256; packed sequences equal to each document alone."""

import pytest
import torch

from helpers import dist, gpu
from helpers.attention import CASES

LOW = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _cases(rank, world, dtype_name):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from helpers.attention import config, inputs, rel, run
    from megatron_overlap.attention import TorchDotProductAttention

    gpu.init()
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    dtype = LOW[dtype_name]
    out = {}
    for case in CASES:
        mt = AttnMaskType[case.mask_type]
        kw = {"softmax_scale": case.softmax_scale}
        ref32 = DotProductAttention(config(case, torch.float32), case.layer_number, mt, "self", **kw)
        meg = DotProductAttention(config(case, dtype), case.layer_number, mt, "self", **kw)
        ours = TorchDotProductAttention(config(case, dtype), case.layer_number, mt, "self", **kw)
        q, k, v, mask = inputs(case, dtype, "cuda")
        exact = run(ref32, *(t.detach().float().requires_grad_() for t in (q, k, v)), mask)
        got, mine = run(ours, q, k, v, mask), run(meg, q, k, v, mask)
        names = ("out", "dq", "dk", "dv")
        out[case.name] = {"vs_megatron": {n: rel(a, b) for n, a, b in zip(names, got, mine)},
                          "ours_vs_fp32": {n: rel(a, b) for n, a, b in zip(names, got, exact)},
                          "megatron_vs_fp32": {n: rel(a, b) for n, a, b in zip(names, mine, exact)},
                          "ran": sorted(ours.ran)}
    return out


@pytest.fixture(scope="module", params=list(LOW))
def low_precision(request):
    return request.param, dist.run(_cases, 1, request.param, env=gpu.ENV, timeout=300)[0]


@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_equals_megatron_in_low_precision_and_is_no_less_accurate(low_precision, case):
    dtype, results = low_precision
    r = results[case]
    assert all(e <= 2e-2 for e in r["vs_megatron"].values()), (dtype, r)
    for name, err in r["ours_vs_fp32"].items():
        assert err <= 1.25 * r["megatron_vs_fp32"][name] + 2e-3, (dtype, name, r)
    if case.startswith("window"):  # flash with window bounds, no mask in memory
        assert r["ran"] == ["varlen window"], r


def _packed(rank, world):
    from megatron.core import parallel_state
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from helpers.attention import Case, config, rel, run
    from megatron_overlap.attention import TorchDotProductAttention

    gpu.init()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    lengths, out = [64, 200, 8, 240], {}
    for name, groups, window in (("causal_gqa", 2, None), ("causal_mqa_window", 1, (32, 0))):
        cfg = config(Case(name, groups=groups, window=window, kv_channels=128), torch.bfloat16)
        ours = TorchDotProductAttention(cfg, 1, AttnMaskType.causal, "self")
        g = torch.Generator().manual_seed(1)
        docs = [[torch.randn(n, 1, h, 128, generator=g).cuda().bfloat16() for h in (8, groups, groups)]
                for n in lengths]
        packed = [torch.cat([d[i][:, 0] for d in docs]).requires_grad_() for i in range(3)]
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32).cuda()
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                 max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
        got = run(ours, *packed, None, packed_seq_params=params)
        dy = torch.randn(got[0].shape, generator=torch.Generator().manual_seed(7)).cuda().bfloat16()
        errs, start = 0.0, 0
        for d, n in zip(docs, lengths):
            x = [t.clone().requires_grad_() for t in d]
            y = ours(*x, None)
            y.backward(dy[start:start + n].reshape(y.shape))
            for a, b in ((got[0][start:start + n], y.detach().float().reshape(n, -1)),) + tuple(
                    (grad[start:start + n], t.grad[:, 0].float()) for t, grad in zip(x, got[1:])):
                errs = max(errs, rel(a, b))
            start += n
        out[name] = (errs, sorted(ours.ran))
    return out


def test_packed_sequences_on_the_gpu_equal_each_document_alone():
    out = dist.run(_packed, 1, env=gpu.ENV, timeout=200)[0]
    for name, (err, ran) in out.items():
        assert "varlen" in ran, (name, ran)  # torch's varlen flash attention ran the pack
        assert err <= 2e-2, (name, err)
