"""FP8 on one GPU, one process: the fused cast (`overlap.fp8._fused_cast`, torch.compile of
the one definition) gives the bits eager torchao gives, the one-pass amax torchao's amax,
the compiled transpose torch's copy, the cast with its transposed copy two compiled
kernels, every kernel compiled however many there are;
row-wise scaled GEMMs run on the GPU's kernel with the operands the layers give them."""

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
    assert f._compiled.get(("cast", dtype, fp8)) is not None, f._compiled


@pytest.mark.parametrize("shape", [(1024, 8192), (8192, 1280), (1000, 272), (16, 16)])
def test_compiled_transpose_equals_torchs_copy(shape):
    """`transposed` (the FP8 GEMMs' layouts) as one compiled kernel: the bytes torch's
    strided copy gives, for contiguous and transposed inputs; the same with the compiled
    kernels switched off (set_fused(False): torch's copy)."""
    from megatron_overlap.overlap import fp8 as f

    t = (torch.randn(*shape, device="cuda") * 100).to(torch.float8_e4m3fn)
    for src in (t, t.t()):
        want = src.t().contiguous().view(torch.uint8)
        got = f.transposed(src)
        assert got.dtype == src.dtype and got.is_contiguous()
        assert torch.equal(got.view(torch.uint8), want)
        before = f.set_fused(False)
        try:
            assert torch.equal(f.transposed(src).view(torch.uint8), want)
        finally:
            f.set_fused(before)
    assert f._compiled.get(("transpose",)) is not None, f._compiled


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("shape", [(1024, 8192), (8192, 1280), (1000, 272)])
def test_cast_with_its_transposed_copy_is_two_compiled_kernels_with_eagers_bits(dtype, fp8, shape):
    """`quantize(..., out_t=)` (the cast that also gives the FP8 GEMMs' other layout, as
    the layers cast the weight, a row layer's input and a column layer's gradient): both
    outputs the bytes eager torchao's cast and torch's transposed copy give, by two
    compiled kernels (counted by the profiler, after a warm-up call that compiles them):
    the cast, then the transpose of its FP8 output. (One function writing both layouts
    compiled to two kernels that each read the wider input: more bytes.)"""
    pytest.importorskip("torchao", reason="the [fp8] extra (torchao) is not installed")
    from torch.profiler import ProfilerActivity, profile
    from torchao.float8 import float8_utils as ao

    from megatron_overlap.overlap import fp8 as f

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(*shape, generator=g) * 40).to(dtype).cuda()
    scale = ao.amax_to_scale(f.amax(x), fp8)
    want = ao.to_fp8_saturated(x.float() * scale, fp8).view(torch.uint8)
    out = torch.empty(shape, dtype=fp8, device="cuda")
    out_t = torch.empty(shape[::-1], dtype=fp8, device="cuda")
    assert f.quantize(x, scale, fp8, out=out, out_t=out_t) is out  # compiles
    assert torch.equal(out.view(torch.uint8), want)
    assert torch.equal(out_t.view(torch.uint8), want.t().contiguous())
    out.zero_(), out_t.zero_()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        f.quantize(x, scale, fp8, out=out, out_t=out_t)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert len(kernels) == 2 and all(k.startswith("triton_") for k in kernels), kernels
    assert torch.equal(out.view(torch.uint8), want)
    assert torch.equal(out_t.view(torch.uint8), want.t().contiguous())


def test_every_compiled_kernel_stays_compiled_past_dynamos_recompile_limit():
    """Each kernel key compiles in a frame of its own (`_own_frame`): dynamo's recompile
    limit (8 variants per code object) once sent every functools.partial compiled after
    the 8th to eager kernels, one dynamo warning in the log. Ten keys here (casts of two input types into two
    FP8 types, the transposed copy, the scales, delayed scaling's cast and update), then
    each again, profiled: Triton kernels only."""
    pytest.importorskip("torchao", reason="the [fp8] extra (torchao) is not installed")
    from torch.profiler import ProfilerActivity, profile

    from megatron_overlap.overlap import fp8 as f

    fp8s = (torch.float8_e4m3fn, torch.float8_e5m2)
    xs = [(torch.randn(512, 256, device="cuda") * 3).to(d) for d in (torch.bfloat16, torch.float32)]
    states = iter([f.AmaxHistory(4, torch.device("cuda")) for _ in range(8)])  # (fills: eager)

    def every_key():
        for x in xs:
            for dt in fp8s:
                s = f.scale_for(f.amax(x), dt)
                f.quantize(x, s, dt, out_t=torch.empty(x.shape[::-1], dtype=dt, device="cuda"))
                st = next(states)
                used, a = torch.empty((), device="cuda"), torch.empty(1, device="cuda")
                f.delayed_quantize(x, st, dt, used, a[0])
                f.update_scale(st, a[0], dt, 0, "max")
    every_key()
    torch.cuda.synchronize()
    assert len([k for k, v in f._compiled.items() if v is not None]) >= 10, f._compiled
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        every_key()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    eager = [n for n in names if not n.startswith("triton_") and "reduce_kernel" not in n
             and "Memset" not in n and "Memcpy" not in n]
    assert not eager, eager  # (amax: torch's one-pass reduction; empties: no kernel)


@pytest.mark.parametrize("first", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_rowwise_gemm_runs_on_the_gpu_as_on_cpu(first):
    """Row-wise FP8 as the layers run it (`rows_quantized`: each row's scale in its 16-byte
    tail, so the first operand is a strided view; the weight per output column;
    `RowScaledGemm` through torch._scaled_mm's row-wise kernel): the GPU accepts these
    operands (the rules `_check_rowwise` holds on CPU) and its product equals the
    dequantized operands' fp32 product within one bf16 rounding plus accumulation
    order, whole and in row chunks."""
    pytest.importorskip("torchao", reason="the [fp8] extra (torchao) is not installed")
    from megatron_overlap.overlap import fp8 as f

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(256, 128, generator=g) * 5).to(torch.bfloat16).cuda()
    w = torch.randn(96, 128, generator=g).to(torch.bfloat16).cuda()
    a = f.rows_quantized(x, first)
    s = f.row_scales(w, torch.float8_e4m3fn)  # [96, 1]: one per output column of x @ w^T
    b = f.quantize(w, s, torch.float8_e4m3fn).t()  # [128, 96], column-major
    gemm = f.RowScaledGemm(s.t(), torch.bfloat16)
    exact = f.rows_dequantized(a, torch.float32) @ (b.float() / s.t())
    whole = gemm(a, b, op="rowwise")
    chunks = torch.empty_like(whole)
    for i in range(4):  # the schedules' chunks: rows of `a` (with their tails), rows of out
        gemm(a[i * 64:(i + 1) * 64], b, chunks[i * 64:(i + 1) * 64], op="rowwise", chunk=i)
    for got in (whole, chunks):
        assert got.dtype == torch.bfloat16
        rel = ((got.float() - exact).abs().max() / exact.abs().max()).item()
        assert rel <= 2 ** -7, rel


def test_compiled_kernels_never_compile_inside_a_capture():
    """A compiled FP8 kernel whose guards would recompile (here a dimension of 1, which
    dynamic shapes specialise) inside a CUDA-graph capture runs eagerly there instead
    (a compile synchronizes, which breaks a capture), gives the same bytes on replay, and
    stays compiled for later calls outside the capture."""
    from megatron_overlap.overlap import fp8 as f

    warm = (torch.randn(64, 48, device="cuda") * 10).to(torch.float8_e4m3fn)
    assert torch.equal(f.transposed(warm).view(torch.uint8), warm.t().contiguous().view(torch.uint8))
    src = (torch.randn(1, 48, device="cuda") * 10).to(torch.float8_e4m3fn)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = f.transposed(src)
    src.copy_((torch.randn(1, 48, device="cuda") * 10).to(torch.float8_e4m3fn))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.view(torch.uint8), src.t().contiguous().view(torch.uint8))
    assert f._compiled.get(("transpose",)) is not None, f._compiled


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_compiled_scale_equals_torchaos(fp8):
    """`scale_for` as one compiled kernel: torchao's `amax_to_scale` bits (it computes in
    fp64 so that compiled and eager agree), from zero and subnormal amaxes to huge ones."""
    pytest.importorskip("torchao", reason="the [fp8] extra (torchao) is not installed")
    from torchao.float8.float8_utils import amax_to_scale

    from megatron_overlap.overlap import fp8 as f

    g = torch.Generator().manual_seed(11)
    vals = torch.cat([torch.tensor([0.0, 1e-30, 1e-12, 448.0, 57344.0, 1e30]),
                      torch.rand(300, generator=g) * 10.0 ** torch.randint(-8, 8, (300,), generator=g)])
    out = torch.empty((), device="cuda")
    for v in vals.cuda():
        v = v.clone()  # a fresh scalar, as an amax is (not a view into the vector)
        assert f.scale_for(v, fp8, out=out) is out
        assert torch.equal(out, amax_to_scale(v, fp8)), v
    assert f._compiled.get(("scale", fp8)) is not None, f._compiled


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("col", [False, True])
def test_delayed_cast_and_update_compiled_equal_eager(dtype, fp8, col):
    """Delayed scaling's quantization (`delayed_quantize`: torch's amax reduction, then the
    history's scale and the cast compiled; with `col` its transposed copy after) and its
    update (`update_scale`, compiled) give eager's bits, three steps running (history 2,
    'max', margin 1). The amax is torch's one-pass reduction, as current scaling's (inductor
    compiled it to a split reduction ~15x slower in a layer, H100); the rest Triton
    kernels, at most the used scale's copy and the cast (and the transposed copy): printed."""
    pytest.importorskip("torchao", reason="the [fp8] extra (torchao) is not installed")
    from torch.profiler import ProfilerActivity, profile

    from megatron_overlap.overlap import fp8 as f

    g = torch.Generator().manual_seed(9)
    xs = [(torch.randn(1024, 2048, generator=g) * m).to(dtype).cuda() for m in (3, 30, 0.3)]
    runs = {}
    for fused in (True, False):
        before = f.set_fused(fused)
        try:
            st, outs = f.AmaxHistory(2, torch.device("cuda")), []
            for x in xs:
                used, a = torch.empty((), device="cuda"), torch.empty(1, device="cuda")
                out_t = torch.empty(x.shape[::-1], dtype=fp8, device="cuda") if col else None
                out = f.delayed_quantize(x, st, fp8, used, a[0], out_t=out_t)
                f.update_scale(st, a[0], fp8, 1, "max")
                outs.append((out.view(torch.uint8).clone(), used.clone(), a.clone(),
                             None if out_t is None else out_t.view(torch.uint8).clone(),
                             st.history.clone(), st.scale.clone()))
            runs[fused] = outs
        finally:
            f.set_fused(before)
    for step, (got, want) in enumerate(zip(runs[True], runs[False])):
        for i, (a, b) in enumerate(zip(got, want)):
            assert (a is None and b is None) or torch.equal(a, b), (step, i)
    assert f._compiled.get(("delayed_cast", dtype, fp8)) is not None, f._compiled
    assert f._compiled.get(("delayed_update", "max", fp8, 1, 2)) is not None, f._compiled
    used, a = torch.empty((), device="cuda"), torch.empty(1, device="cuda")
    out_t = torch.empty(xs[0].shape[::-1], dtype=fp8, device="cuda") if col else None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        f.delayed_quantize(xs[0], st, fp8, used, a[0], out_t=out_t)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    print(f"delayed cast {dtype} -> {fp8}, col={col}: {len(kernels)} kernels {kernels}")
    reductions = [k for k in kernels if "reduce_kernel" in k]
    compiled = [k for k in kernels if k.startswith("triton_")]
    memsets = [k for k in kernels if k.startswith("Memset")]  # (torch's reduction's, as tensorwise's)
    assert len(reductions) == 1, kernels
    assert len(compiled) + len(reductions) + len(memsets) == len(kernels), kernels  # none eager
    assert 1 <= len(compiled) <= 2 + col, kernels
