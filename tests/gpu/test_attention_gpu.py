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

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _megatron_tp1():
    """Megatron at TP=1, with its CUDA RNG tracker seeded (its attention forks it)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(0)


def mask_for_megatron(case, dtype):
    from helpers.attention import inputs

    return inputs(case, dtype, "cuda", which=case.ref_mask)[3]


def _cases(rank, world):
    """Every case in every dtype, in one process (one CUDA and Megatron start-up for all)."""
    gpu.init()
    _megatron_tp1()
    return {name: _cases_in(name) for name in DTYPES}


def _cases_in(dtype_name):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from helpers.attention import config, inputs, rel, run
    from megatron_overlap.attention import TorchDotProductAttention

    dtype = DTYPES[dtype_name]
    out = {}
    for case in CASES:
        mt = AttnMaskType[case.mask_type]
        kw = {"softmax_scale": case.softmax_scale}
        ref32 = DotProductAttention(config(case, torch.float32), case.layer_number, mt, "self", **kw)
        ref_mask = mask_for_megatron(case, dtype)
        meg = DotProductAttention(config(case, dtype), case.layer_number, mt, "self", **kw)
        ours = TorchDotProductAttention(config(case, dtype), case.layer_number, mt, "self", **kw)
        q, k, v, mask = inputs(case, dtype, "cuda")
        exact = run(ref32, *(t.detach().float().requires_grad_() for t in (q, k, v)), ref_mask)
        got, mine = run(ours, q, k, v, mask), run(meg, q, k, v, ref_mask)
        names = ("out", "dq", "dk", "dv")
        out[case.name] = {"vs_megatron": {n: rel(a, b) for n, a, b in zip(names, got, mine)},
                          "ours_vs_fp32": {n: rel(a, b) for n, a, b in zip(names, got, exact)},
                          "megatron_vs_fp32": {n: rel(a, b) for n, a, b in zip(names, mine, exact)},
                          "ran": sorted(ours.ran)}
    return out


@pytest.fixture(scope="module")
def every_dtype():
    return dist.run(_cases, 1, env=gpu.ENV, timeout=400)[0]


# one xdist worker takes them all (`--dist loadgroup`): the fixture then runs once
@pytest.mark.xdist_group("attention")
@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("case", [c.name for c in CASES])
def test_equals_megatron_in_low_precision_and_is_no_less_accurate(every_dtype, dtype, case):
    r = every_dtype[dtype][case]
    assert all(e <= 2e-2 for e in r["vs_megatron"].values()), (dtype, r)
    for name, err in r["ours_vs_fp32"].items():
        assert err <= 1.25 * r["megatron_vs_fp32"][name] + 2e-3, (dtype, name, r)
    # flash with window bounds, no mask in memory, where flash runs (half precision) and every
    # query sees a key; the window as a mask otherwise
    flash = dtype != "float32" and case.startswith("window") and case != "window_queries_without_keys"
    assert (r["ran"] == ["varlen window"]) == flash, r


def _packed(rank, world):
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.enums import AttnMaskType

    from helpers.attention import Case, config, rel, run
    from megatron_overlap.attention import TorchDotProductAttention

    gpu.init()
    _megatron_tp1()
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


def _mla(rank, world):
    """MLA's core attention (query/key head dim 192, value head dim 128: flash cannot take
    them) against an fp64 reference, causal and windowed."""
    from megatron.core.transformer.enums import AttnMaskType

    from helpers.attention import Case, config
    from megatron_overlap.attention import TorchDotProductAttention

    gpu.init()
    _megatron_tp1()
    out = {}
    for window in (None, (16, 0)):
        cfg = config(Case("mla", groups=8, window=window), torch.bfloat16)
        mla = TorchDotProductAttention(cfg, 1, AttnMaskType.causal, "self", k_channels=192,
                                       v_channels=128, softmax_scale=0.07)
        g = torch.Generator().manual_seed(0)
        q, k = (torch.randn(64, 2, 8, 192, generator=g).cuda().bfloat16() for _ in range(2))
        v = torch.randn(64, 2, 8, 128, generator=g).cuda().bfloat16()
        got = mla(q, k, v, None).double()
        qd, kd, vd = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))
        s = qd @ kd.transpose(-1, -2) * 0.07
        i, j = torch.arange(64, device="cuda")[:, None], torch.arange(64, device="cuda")[None, :]
        seen = (j <= i) & ((j >= i - window[0]) if window else True)
        want = (s.masked_fill(~seen, float("-inf")).softmax(-1) @ vd).permute(2, 0, 1, 3).reshape(64, 2, -1)
        out[str(window)] = (gpu.rel(got, want), sorted(mla.ran))
    return out


def test_mla_head_dims_run_on_the_sdpa_path():
    for window, (err, ran) in dist.run(_mla, 1, env=gpu.ENV, timeout=120)[0].items():
        assert err <= 1e-2 and "varlen window" not in ran, (window, err, ran)


def test_packed_sequences_on_the_gpu_equal_each_document_alone():
    out = dist.run(_packed, 1, env=gpu.ENV, timeout=200)[0]
    for name, (err, ran) in out.items():
        assert "varlen" in ran, (name, ran)  # torch's varlen flash attention ran the pack
        assert err <= 2e-2, (name, err)
