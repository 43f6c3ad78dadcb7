"""`overlap.pass_fn`, the one place the tools get a layer pass from, with the GEMM seam
it is given: an FP8 GEMM's pass writes its output in the GEMM's `out_dtype` and equals
`torch._scaled_mm` of the whole tensors; the default keeps the input's dtype. On the mirror
transport (`ab.emulated_tp`: every peer holds this rank's tensors), so every row is
defined."""

import pytest
import torch

from megatron_overlap.ab.emulated_tp import MirrorTransport
from megatron_overlap.overlap.fp8 import ScaledGemm
from megatron_overlap.overlap.pass_fn import pass_fn

WORLD, RANK, ROWS, K, N = 4, 3, 32, 64, 48


def _fp8(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (448.0 / t.abs().max()).float().reshape(())
    return (t * scale).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("op,method,splits", [("ag", "ring_exchange", 1), ("ag", "bulk", 1),
                                              ("rs", "pipeline", 2)])
def test_an_fp8_gemm_s_pass_equals_scaled_mm_on_its_own_rows(op, method, splits):
    g = torch.Generator().manual_seed(0)
    rows = ROWS if op == "ag" else ROWS * WORLD
    (x, sx), (w, sw) = _fp8(torch.randn(rows, K, generator=g)), _fp8(torch.randn(N, K, generator=g))
    gemm = ScaledGemm(sx, sw, torch.bfloat16, fast_accum=False)
    out = pass_fn(x, w, MirrorTransport(WORLD, RANK), op, method, splits, name="t", gemm=gemm)()
    assert out.dtype == torch.bfloat16
    want = torch._scaled_mm(x, w.t(), scale_a=1 / sx, scale_b=1 / sw, out_dtype=torch.bfloat16)
    if op == "ag":  # every peer's block is this rank's
        torch.testing.assert_close(out, want.repeat(WORLD, 1))
    else:  # the sum over WORLD peers of this rank's block
        torch.testing.assert_close(out.float(), WORLD * want[RANK * ROWS:(RANK + 1) * ROWS].float(),
                                   rtol=1e-2, atol=1e-2)


def test_the_default_gemm_keeps_the_inputs_dtype():
    x, w = torch.randn(ROWS, K), torch.randn(N, K)
    out = pass_fn(x, w, MirrorTransport(WORLD, RANK), "ag", "ring_exchange", 1, name="t")()
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, (x @ w.t()).repeat(WORLD, 1))
