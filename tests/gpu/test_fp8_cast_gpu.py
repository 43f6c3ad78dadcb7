"""FP8 casts on the GPU: the fused kernel (`overlap.fp8._fused_cast`, torch.compile of the one
definition) gives the bits eager torchao gives, and the one-pass amax torchao's amax."""

import pytest
import torch


def _inputs(dtype):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1000, 257, generator=g) * 40
    x[0, :4] = torch.tensor([0.0, -0.0, 1e-30, -3e4])  # zeros, a subnormal, a saturating value
    yield "contiguous", x.to(dtype).cuda()
    yield "transposed view", x.to(dtype).cuda().t()
    yield "3-d", x[:992].reshape(8, 124, 257).to(dtype).cuda()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fused_cast_equals_eager_bit_for_bit(dtype, fp8):
    pytest.importorskip("torchao", reason="the [fp8] extra (torchao) is not installed")
    from torchao.float8 import float8_utils as ao

    from megatron_overlap.overlap import fp8 as f

    for name, x in _inputs(dtype):
        a = ao.tensor_to_amax(x).float()
        assert torch.equal(f.amax(x), a), name
        scale = ao.amax_to_scale(a, fp8)
        got = f.quantize(x, scale, fp8)
        want = ao.to_fp8_saturated(x.float() * scale, fp8)
        assert got.dtype == fp8 and got.shape == x.shape, name
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), name
        out = torch.empty(x.shape, dtype=fp8, device="cuda")
        assert f.quantize(x, scale, fp8, out=out) is out
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), name
    # the fused kernel ran (a failed compile sets its entry to None and logs)
    assert f._fused.get((dtype, fp8)) is not None, f._fused
