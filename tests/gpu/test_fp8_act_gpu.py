"""The SwiGLU fused with its FP8 casts on a GPU (overlap/fp8_act.py: one Triton kernel per
pass, overlap/fp8_triton.py `swiglu_tile`) against its eager definition on the same GPU
(the SwiGLU in float32 with torch's ops, then `overlap.fp8`'s casts, the Triton kernels
off): the amax and scale pair within float32's last bits, and the FP8 bytes equal but
where Triton's sigmoid and torch's differ in their last float32 bits and the product lands
on a rounding boundary (at most 1 in 10^4 elements, each one FP8 step off); the transposed copy and
the chunk-major rows are the same bytes moved; one kernel ran per pass (two for current
scaling: its amax, then the cast)."""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available()
                                or torch.cuda.get_device_capability() < (8, 9),
                                reason="FP8 needs a GPU of compute capability 8.9 or newer")


def unwritten(shape, fp8: torch.dtype) -> torch.Tensor:
    """Every byte 0x7F (a NaN in both FP8 formats): the kernel must write each one."""
    return torch.full(tuple(shape), 0x7F, dtype=torch.uint8, device="cuda").view(fp8)


def _run(act, y, g, fp8, chunks, delayed, fused: bool):
    from megatron_overlap.overlap import fp8 as f
    from megatron_overlap.overlap import fp8_act, fp8_kernels

    m, n = y.shape[0], (y.shape[1] // 2 if act == "swiglu" else y.shape[1])
    out, out_t = unwritten((m, n), fp8), unwritten((n, m), fp8)
    pair = f.scale_pair("cuda")
    amax = torch.empty((), dtype=torch.float32, device="cuda")
    state = None
    if delayed:
        state = f.AmaxHistory(4, torch.device("cuda"))
        state.scale.copy_(f.pair_of(torch.tensor(16.0, device="cuda")))
    ran, go = [], fp8_kernels._go

    def counted(name, launch, capturing):  # the activation kernels launched, by name
        ok = go(name, launch, capturing)
        if ok and launch.flags.get("ACT"):
            ran.append(name)
        return ok
    previous = f.set_fused(fused)
    fp8_kernels._go = counted
    try:
        fp8_act.quantized(act, y, g, fp8, pair, out, out_t, chunks, state, amax)
    finally:
        f.set_fused(previous)
        fp8_kernels._go = go
    torch.cuda.synchronize()
    return out, out_t, pair, amax, ran


@pytest.mark.parametrize("act,chunks", [("swiglu", None), ("swiglu", (4, 2)),
                                        ("swiglu_grad", None)])
@pytest.mark.parametrize("delayed", [False, True], ids=["current", "delayed"])
# (1000 x 352: fc1's output halves 176 wide, the forward's last column tile partial, the
# backward's tiles 16 wide)
@pytest.mark.parametrize("shape", [(8192, 7168), (1000, 512), (1000, 352)])
def test_the_fused_swiglu_cast_is_its_eager_definition(act, chunks, delayed, shape):
    pytest.importorskip("torchao", reason="the [fp8] extra (torchao) is not installed")
    from megatron_overlap.overlap import fp8 as f

    m, two_h = shape
    if chunks and m % (chunks[0] * chunks[1]):
        m = m // 8 * 8
    gen = torch.Generator().manual_seed(11)
    y = (torch.randn(m, two_h, generator=gen) * 3).bfloat16().cuda()
    g = torch.randn(m, two_h // 2, generator=gen).bfloat16().cuda() if act != "swiglu" else None
    fp8 = torch.float8_e4m3fn if act == "swiglu" else torch.float8_e5m2
    got = _run(act, y, g, fp8, chunks, delayed, fused=True)
    want = _run(act, y, g, fp8, chunks, delayed, fused=False)
    mode = "delayed" if delayed else "current"
    assert got[4] == ([f"{act}_delayed"] if delayed else [f"{act}_amax", f"{act}_{mode}"]), got[4]
    assert not want[4]
    # the amax, and the scale pair made from it: Triton's exp is not torch's, so the
    # largest value may differ in its last float32 bits
    torch.testing.assert_close(got[3], want[3], rtol=1e-6, atol=0)
    torch.testing.assert_close(got[2], want[2], rtol=1e-6, atol=0)
    for a, b in ((got[0], want[0]), (got[1], want[1])):
        ab, bb = a.view(torch.uint8), b.view(torch.uint8)
        off = ab != bb
        assert off.float().mean().item() <= 1e-4, off.float().mean().item()
        # (an FP8 step: adjacent codes of one sign, as bytes differ by 1)
        assert ((ab[off].int() - bb[off].int()).abs() <= 1).all()
    # the transposed copy is the rows' bytes moved (rows back in order where chunk-major)
    rows = got[0] if chunks is None else f.chunk_major(got[0], chunks[1], chunks[0])
    assert torch.equal(got[1].view(torch.uint8), rows.t().contiguous().view(torch.uint8))
