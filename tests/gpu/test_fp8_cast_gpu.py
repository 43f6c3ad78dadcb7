"""FP8 on one GPU, one process: the fused cast (`overlap.fp8._fused_cast`, torch.compile of
the one definition) gives the bits eager torchao gives, the amax (a Triton kernel where
the tensor is contiguous, else torch's one-pass reduction) torchao's amax, the scale pair
torchao's scale and fp32's reciprocal of it,
the Triton transpose torch's copy, the cast with its transposed copy one Triton kernel
(overlap/fp8_kernels.py) with eager's bits, delayed scaling's cast with its amax too,
every kernel compiled however many there are;
row-wise scaled GEMMs run on the GPU's kernel with the operands the layers give them."""

import pytest
import torch


def unwritten(shape, fp8: torch.dtype) -> torch.Tensor:
    """An FP8 output every byte of which the kernel must write: all 0x7F, a NaN in both
    formats, which no finite input casts to. (torch.empty could hand back a block still
    holding the expected bytes of an earlier case, which once hid rows a kernel left
    unwritten.)"""
    return torch.full(tuple(shape), 0x7F, dtype=torch.uint8, device="cuda").view(fp8)


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
        out = unwritten(x.shape, fp8)
        assert f.quantize(x, scale, fp8, out=out) is out
        assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), name
    # the fused kernel ran (a failed compile sets its entry to None and logs)
    assert f._compiled.get(("cast", dtype, fp8)) is not None, f._compiled


def _transposes(sig) -> bool:
    """Whether a launch signature (overlap/fp8_kernels.py's `run`) is a transpose's."""
    return sig[0] == "cast_t" and not dict(sig[1])["CAST"]


@pytest.mark.parametrize("shape", [(1024, 8192), (8192, 1280), (1000, 272), (16, 16)])
def test_transpose_equals_torchs_copy(shape):
    """`transposed` (the FP8 GEMMs' layouts) as one kernel: the bytes torch's strided copy
    gives, for a contiguous input (the Triton kernel) and a transposed view (which it does
    not take: the compiled kernel); the same with the kernels switched off
    (set_fused(False): torch's copy)."""
    from megatron_overlap.overlap import fp8 as f
    from megatron_overlap.overlap import fp8_kernels as k

    t = (torch.randn(*shape, device="cuda") * 100).to(torch.float8_e4m3fn)
    k._seen -= {sig for sig in k._seen if _transposes(sig)}  # this test's own
    for src in (t, t.t()):
        want = src.t().contiguous().view(torch.uint8)
        got = f.transposed(src, out=unwritten(src.shape[::-1], src.dtype))
        assert got.dtype == src.dtype and got.is_contiguous()
        assert torch.equal(got.view(torch.uint8), want)
        before = f.set_fused(False)
        try:
            assert torch.equal(f.transposed(src).view(torch.uint8), want)
        finally:
            f.set_fused(before)
    assert f._compiled.get(("transpose",)) is not None, f._compiled
    assert any(_transposes(sig) for sig in k._seen), k._seen  # Triton's ran


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("shape", [(1024, 8192), (8192, 1280), (1000, 272)])
def test_cast_with_its_transposed_copy_is_one_kernel_with_eagers_bits(dtype, fp8, shape):
    """`quantize(..., out_t=)` (the cast that also gives the FP8 GEMMs' other layout, as
    the layers cast the weight, a row layer's input and a column layer's gradient): both
    outputs the bytes eager torchao's cast and torch's transposed copy give, by one
    Triton kernel (overlap/fp8_kernels.py's cast-transpose, counted by the profiler after
    a warm-up call that compiles it), on shapes that fill its tiles and shapes that do not."""
    pytest.importorskip("torchao", reason="the [fp8] extra (torchao) is not installed")
    from torch.profiler import ProfilerActivity, profile
    from torchao.float8 import float8_utils as ao

    from megatron_overlap.overlap import fp8 as f

    g = torch.Generator().manual_seed(5)
    x = (torch.randn(*shape, generator=g) * 40).to(dtype).cuda()
    scale = ao.amax_to_scale(f.amax(x), fp8)
    want = ao.to_fp8_saturated(x.float() * scale, fp8).view(torch.uint8)
    out = unwritten(shape, fp8)
    out_t = unwritten(shape[::-1], fp8)
    assert f.quantize(x, scale, fp8, out=out, out_t=out_t) is out  # compiles
    assert torch.equal(out.view(torch.uint8), want)
    assert torch.equal(out_t.view(torch.uint8), want.t().contiguous())
    out.zero_(), out_t.zero_()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        f.quantize(x, scale, fp8, out=out, out_t=out_t)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert len(kernels) == 1 and kernels[0].startswith("cast_t"), kernels
    assert torch.equal(out.view(torch.uint8), want)
    assert torch.equal(out_t.view(torch.uint8), want.t().contiguous())


def test_every_compiled_kernel_stays_compiled_past_dynamos_recompile_limit():
    """Each kernel key compiles in a frame of its own (`_own_frame`): dynamo's recompile
    limit (8 variants per code object) once sent every functools.partial compiled after
    the 8th to eager kernels, one dynamo warning in the log. Keys here: casts of two input
    types into two FP8 types and the scales (compiled), with the Triton kernels beside
    them (the cast-transposes, delayed scaling's casts and its update at two history
    lengths), then each again, profiled: compiled or Triton kernels only."""
    pytest.importorskip("torchao", reason="the [fp8] extra (torchao) is not installed")
    from torch.profiler import ProfilerActivity, profile

    from megatron_overlap.overlap import fp8 as f

    fp8s = (torch.float8_e4m3fn, torch.float8_e5m2)
    xs = [(torch.randn(512, 256, device="cuda") * 3).to(d) for d in (torch.bfloat16, torch.float32)]
    states = iter([f.AmaxHistory(n, torch.device("cuda")) for _ in range(4) for n in (4, 8)])

    def every_key():
        for x in xs:
            for dt in fp8s:
                s = f.scale_for(f.amax(x), dt)
                f.quantize(x, s, dt)
                f.quantize(x, s, dt, out_t=unwritten(x.shape[::-1], dt))
                f.quantize_current(x, f.amax(x), dt, f.scale_pair("cuda"),
                                   out_t=unwritten(x.shape[::-1], dt))
                for _ in range(2):
                    st = next(states)
                    used, a = f.scale_pair("cuda"), torch.empty(1, device="cuda")
                    f.delayed_quantize(x, st, dt, used, a[0])
                    f.update_scale(st, a[0], dt, 0, "max")
    every_key()
    torch.cuda.synchronize()
    assert len([k for k, v in f._compiled.items() if v is not None]) >= 6, f._compiled
    states = iter([f.AmaxHistory(n, torch.device("cuda")) for _ in range(4) for n in (4, 8)])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        every_key()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    eager = [n for n in names if not n.startswith(("triton_", "cast_t", "fp8_amax",
                                                   "delayed_update"))
             and "Memset" not in n and "Memcpy" not in n and "FillFunctor" not in n]
    # (an amax's scalar zeroed: a fill; empties: no kernel)
    assert not eager, eager


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
    gemm = f.RowScaledGemm(s.t(), torch.bfloat16, fast_accum=False)
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
    """A compiled FP8 kernel whose guards would recompile (here a length of 1, which
    dynamic shapes specialise) inside a CUDA-graph capture runs eagerly there instead
    (a compile synchronizes, which breaks a capture), gives the same bytes on replay, and
    stays compiled for later calls outside the capture. A Triton kernel's launch signature
    not compiled yet (here FP8 values at an odd address) declines there the same way: the
    compiled kernel runs, captured so (or eager, where this process has not compiled it);
    once launched outside, the capture takes it."""
    pytest.importorskip("torchao", reason="the [fp8] extra (torchao) is not installed")
    from torchao.float8 import float8_utils as ao

    from megatron_overlap.overlap import fp8 as f
    from megatron_overlap.overlap import fp8_kernels as k

    e4m3 = torch.float8_e4m3fn
    scale = torch.full((), 3.0, device="cuda")
    f.quantize(torch.randn(64, 48, device="cuda", dtype=torch.bfloat16), scale, e4m3)  # compiles
    one = torch.randn(1, 1, device="cuda", dtype=torch.bfloat16)
    base = (torch.randn(65, 48, device="cuda") * 10).to(e4m3)
    odd = base.view(-1)[1:48 * 64 + 1].view(64, 48)  # 1 byte past an aligned address
    k._seen -= {sig for sig in k._seen if not sig[3][0]}  # forget odd addresses launched before
    seen = set(k._seen)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = f.quantize(one, scale, e4m3)
        t = f.transposed(odd)
    assert k._seen == seen  # the new signature did not run in the capture
    one.copy_(torch.randn(1, 1, device="cuda"))
    base.copy_((torch.randn(65, 48, device="cuda") * 10).to(e4m3))
    graph.replay()
    torch.cuda.synchronize()
    want = ao.to_fp8_saturated(one.float() * scale, e4m3)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(t.view(torch.uint8), odd.t().contiguous().view(torch.uint8))
    assert f._compiled.get(("cast", torch.bfloat16, e4m3)) is not None, f._compiled
    assert torch.equal(f.transposed(odd).view(torch.uint8), odd.t().contiguous().view(torch.uint8))
    assert len(k._seen) == len(seen) + 1  # outside: compiled and launched


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_compiled_scale_equals_torchaos(fp8):
    """`scale_for` as one compiled kernel: the pair of torchao's `amax_to_scale` bits (it
    computes in fp64 so that compiled and eager agree) and fp32's reciprocal of them (what
    a scaled GEMM took before the pairs), from zero and subnormal amaxes to huge ones."""
    pytest.importorskip("torchao", reason="the [fp8] extra (torchao) is not installed")
    from torchao.float8.float8_utils import amax_to_scale

    from megatron_overlap.overlap import fp8 as f

    g = torch.Generator().manual_seed(11)
    vals = torch.cat([torch.tensor([0.0, 1e-30, 1e-12, 448.0, 57344.0, 1e30]),
                      torch.rand(300, generator=g) * 10.0 ** torch.randint(-8, 8, (300,), generator=g)])
    out = f.scale_pair("cuda")
    for v in vals.cuda():
        v = v.clone()  # a fresh scalar, as an amax is (not a view into the vector)
        assert f.scale_for(v, fp8, out=out) is out
        want = amax_to_scale(v, fp8)
        assert torch.equal(out, f.pair_of(want, want.reciprocal())), (v, out)
    assert f._compiled.get(("scale", fp8, 0)) is not None, f._compiled


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("col", [False, True])
def test_delayed_cast_and_update_compiled_equal_eager(dtype, fp8, col):
    """Delayed scaling's quantization (`delayed_quantize`: one Triton kernel casting with
    the history's scale, reducing the amax and copying the scale used, with `col` writing
    the transposed layout too) and its update (`update_scale`, a Triton kernel) give eager's bits
    (torch's amax reduction, the cast, the transposed copy), three steps running (history
    2, 'max', margin 1), a NaN's amax included: two kernels, the amax's zeroing and the
    cast (printed)."""
    pytest.importorskip("torchao", reason="the [fp8] extra (torchao) is not installed")
    from torch.profiler import ProfilerActivity, profile

    from megatron_overlap.overlap import fp8 as f

    g = torch.Generator().manual_seed(9)
    xs = [(torch.randn(1000, 2056, generator=g) * m).to(dtype).cuda() for m in (3, 30, 0.3)]
    nan = xs[1].clone()
    nan[999, 2055] = float("nan")  # the last tile's last element
    xs.insert(2, nan)  # its amax NaN (recorded as 0: the scale kept), in both paths
    runs = {}
    for fused in (True, False):
        before = f.set_fused(fused)
        try:
            st, outs = f.AmaxHistory(2, torch.device("cuda")), []
            for x in xs:
                used, a = f.scale_pair("cuda"), torch.empty(1, device="cuda")
                out_t = unwritten(x.shape[::-1], fp8) if col else None
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
            assert (a is None and b is None) or torch.equal(a, b) or (
                a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                and torch.equal(a.nan_to_num(), b.nan_to_num())), (step, i, a, b)
    assert runs[True][2][2].isnan().all()  # the NaN's amax
    from megatron_overlap.overlap import fp8_kernels

    assert any(sig[0] == "delayed_update" for sig in fp8_kernels._seen), fp8_kernels._seen
    used, a = f.scale_pair("cuda"), torch.empty(1, device="cuda")
    out_t = unwritten(xs[0].shape[::-1], fp8) if col else None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        f.delayed_quantize(xs[0], st, fp8, used, a[0], out_t=out_t)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    print(f"delayed cast {dtype} -> {fp8}, col={col}: {len(kernels)} kernels {kernels}")
    assert len(kernels) == 2 and kernels[1].startswith("cast_t"), kernels  # the zeroing, the cast


@pytest.mark.parametrize("length", [1, 4, 1024, 2000])
@pytest.mark.parametrize("algo,margin,fp8", [("max", 0, torch.float8_e4m3fn),
                                             ("most_recent", 1, torch.float8_e5m2)])
def test_a_pass_s_update_is_one_kernel_with_eagers_bits(length, algo, margin, fp8):
    """`update_scales` on two rows of a block of three (a forward's input and weight), each
    rank's amaxes a column slice of the exchange's result (4 ranks, row stride 3): the
    Triton kernel ('delayed_update', one launch), the compiled function (the kernel turned
    off) and eager give the same histories and scale pairs, bit for bit, over steps whose
    amaxes take in NaN from one rank, inf, 0, a subnormal and float32's largest, from
    histories one of which holds a NaN (as a checkpoint could bring: under 'max' its scale
    stays until the NaN leaves the window); the row not updated is untouched."""
    pytest.importorskip("torchao", reason="the [fp8] extra (torchao) is not installed")
    from torch.profiler import ProfilerActivity, profile

    from megatron_overlap.overlap import fp8 as f
    from megatron_overlap.overlap import fp8_kernels

    g = torch.Generator().manual_seed(11)
    steps = [torch.rand(4, 3, generator=g) * 10.0 ** e for e in (-2, 0, 3, 1, -40, 38, 2)]
    steps[1][2, 0] = float("nan")
    steps[3][0, 1] = float("inf")
    steps[4][:, 1] = 0.0
    steps[5][2, 0] = torch.finfo(torch.float32).max
    h0 = torch.rand(3, length, generator=g)
    h0[2, 0] = float("nan")
    h0 = h0.cuda()
    s0 = torch.tensor([[0.5, 2.0], [0.25, 4.0], [0.125, 8.0]], device="cuda")
    runs = {}
    for how in ("triton", "compiled", "eager"):
        before = f.set_fused(how != "eager")
        broken = set(fp8_kernels._broken)
        if how == "compiled":
            fp8_kernels._broken.add("delayed_update")
        try:
            h, s, seen = h0.clone(), s0.clone(), []
            for every in steps:
                every = every.cuda()[:, :2]
                f.update_scales(h[1:], s[1:], every, fp8, margin, algo)
                seen.append((h.clone(), s.clone()))
            runs[how] = seen
            if how == "compiled":  # (a failed compile would have run eagerly: nothing compared)
                assert any(key[0] == "delayed_update" and fn is not None
                           for key, fn in f._compiled.items()), f._compiled
        finally:
            f.set_fused(before)
            fp8_kernels._broken.clear()
            fp8_kernels._broken.update(broken)
    for how in ("triton", "compiled"):
        for step, ((h, s), (wh, ws)) in enumerate(zip(runs[how], runs["eager"])):
            assert torch.equal(h, wh) and torch.equal(s, ws), (how, step, h, wh, s, ws)
    assert torch.equal(runs["eager"][-1][0][0], h0[0]) and torch.equal(runs["eager"][-1][1][0], s0[0])
    h, s, every = h0.clone(), s0.clone(), steps[0].cuda()[:, :2]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        f.update_scales(h[1:], s[1:], every, fp8, margin, algo)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert kernels == ["delayed_update"], kernels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_amax_kernel_equals_torchs_reduction(dtype):
    """`amax` on a contiguous tensor: the 'amax' Triton kernel (the scalar zeroed, then one
    kernel), torch's reduction's bits on sizes that fill its blocks and sizes that do not,
    1-, 2- and 3-D, all zeros, negative maxima, inf; a NaN anywhere, of either sign, makes
    it NaN; a transposed view runs torch's reduction."""
    pytest.importorskip("torchao", reason="the [fp8] extra (torchao) is not installed")
    from torch.profiler import ProfilerActivity, profile

    from megatron_overlap.overlap import fp8 as f

    g = torch.Generator().manual_seed(13)
    cases = [torch.randn(n, generator=g) * 7 for n in (1, 17, 8192, 8193, 3 * 8192 - 5)]
    cases += [torch.randn(1000, 257, generator=g) - 9, torch.zeros(64, 48),
              torch.randn(4, 33, 96, generator=g)]
    cases[-3][500, 3] = -1e4  # the largest |x| negative
    inf = torch.randn(8200, generator=g)
    inf[8199] = float("-inf")  # in the last block's tail
    cases.append(inf)
    for x in cases:
        x = x.to(dtype).cuda()
        want = torch.linalg.vector_norm(x, float("inf"), dtype=torch.float32)
        assert torch.equal(f.amax(x), want), (x.shape, f.amax(x), want)
        if x.dim() == 2:
            assert torch.equal(f.amax(x.t()), want)  # (not contiguous: torch's reduction)
    for negative in (False, True):
        x = torch.randn(3000, 64, generator=g).to(dtype).cuda()
        x[2999, 63] = float("nan")
        # the sign bit set on the bits (a GPU's neg may give back a positive NaN, and torch's
        # signbit of a half NaN on an H200 said False for one with the bit set)
        bits = x.view({2: torch.int16, 4: torch.int32}[x.element_size()])
        if negative:
            bits[2999, 63] |= torch.iinfo(bits.dtype).min
        assert bool(bits[2999, 63] < 0) == negative
        assert f.amax(x).isnan(), negative
    x = torch.randn(4096, 1024, generator=g).to(dtype).cuda()
    f.amax(x)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        a = f.amax(x)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert len(kernels) == 2 and kernels[1].startswith("fp8_amax"), kernels  # zeroed, reduced
    assert torch.equal(a, x.float().abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("col", [False, True])
def test_current_cast_makes_its_scale_with_eagers_bits_in_one_kernel(dtype, fp8, col):
    """`quantize_current` (current scaling as the layers run it): one Triton kernel makes
    the scale from the amax, or from the max of a TP group's amaxes, writes the scale pair
    and casts (with `col`, both layouts): the pair torchao's scale and fp32's reciprocal of
    it, the bytes eager's (`scale_for`, then the cast), for amaxes of 0, a NaN, inf and
    ordinary ones; the same with the kernels off."""
    pytest.importorskip("torchao", reason="the [fp8] extra (torchao) is not installed")
    from torch.profiler import ProfilerActivity, profile
    from torchao.float8.float8_utils import amax_to_scale

    from megatron_overlap.overlap import fp8 as f

    g = torch.Generator().manual_seed(17)
    x = (torch.randn(1000, 272, generator=g) * 30).to(dtype).cuda()
    a = f.amax(x)
    cases = [a, torch.stack([a * 0.5, a * 3, a]), torch.zeros(()), torch.tensor([a.item(),
             float("nan")]), torch.tensor(float("inf")), torch.rand(33, generator=g) * 100]
    for amaxes in cases:
        amaxes = amaxes.float().cuda()
        runs = []
        for fused in (True, False):
            before = f.set_fused(fused)
            try:
                pair = f.scale_pair("cuda")
                out_t = unwritten(x.shape[::-1], fp8) if col else None
                out = f.quantize_current(x, amaxes, fp8, pair, out_t=out_t)
                runs.append((pair.clone(), out.view(torch.uint8).clone(),
                             None if out_t is None else out_t.view(torch.uint8).clone()))
            finally:
                f.set_fused(before)
        want = amax_to_scale(amaxes.amax(), fp8)
        want = f.pair_of(want, want.reciprocal())
        for pair, got, got_t in runs:
            assert torch.equal(pair.nan_to_num(), want.nan_to_num()), (amaxes, pair, want)
            assert torch.equal(pair.isnan(), want.isnan())
            if want.isnan().any():  # every value NaN (its encoding's sign aside)
                assert got.view(fp8).float().isnan().all(), amaxes
            else:
                assert torch.equal(got, runs[1][1]), amaxes  # the kernel's bytes = eager's
            if col:
                assert torch.equal(got_t, got.view(x.shape).t().contiguous().view(torch.uint8))
    pair, amaxes = f.scale_pair("cuda"), cases[1].float().cuda()
    out_t = unwritten(x.shape[::-1], fp8) if col else None
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        f.quantize_current(x, amaxes, fp8, pair, out_t=out_t)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert len(kernels) == 1 and kernels[0].startswith("cast_t"), kernels


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("col", [False, True])
@pytest.mark.parametrize("blocks,chunks", [(8, 4), (4, 2), (2, 3)])
def test_a_chunk_major_cast_is_one_kernel_with_the_row_order_bytes_reordered(dtype, col, blocks,
                                                                             chunks):
    """Current and delayed casts with `chunks` (a row layer's FP8 input for its pipelined
    reduce-scatter): one Triton kernel writes x8 chunk-major, every byte of it (outputs
    filled with 0x7F first), the row-order cast's bytes reordered by `chunk_major`; the
    transposed copy, the scale pair and the amax as the row-order cast writes them. At 2 x
    3 the rows (8190) make chunks of 1365, which the kernel's 64-row tiles straddle."""
    pytest.importorskip("torchao", reason="the [fp8] extra (torchao) is not installed")
    from torch.profiler import ProfilerActivity, profile

    from megatron_overlap.overlap import fp8 as f

    fp8 = torch.float8_e4m3fn
    rows = 8190 if (blocks, chunks) == (2, 3) else 8192
    x = (torch.randn(rows, 1024, generator=torch.Generator().manual_seed(5)) * 30).to(dtype).cuda()
    amaxes = f.amax(x).reshape(1)
    state = f.AmaxHistory(4, x.device)
    state.scale.copy_(f.pair_of(torch.tensor(3.0)).cuda())

    def buffers():
        return (unwritten(x.shape, fp8), unwritten(x.shape[::-1], fp8) if col else None,
                f.scale_pair("cuda"), torch.zeros((), device="cuda"))

    def cast(order, delayed: bool, bufs):
        out, out_t, pair, amax = bufs
        if delayed:
            f.delayed_quantize(x, state, fp8, pair, amax, out=out, out_t=out_t, chunks=order)
        else:
            f.quantize_current(x, amaxes, fp8, pair, out=out, out_t=out_t, chunks=order)
        return bufs

    for delayed in (False, True):
        want, want_t, want_pair, want_amax = cast(None, delayed, buffers())
        bufs = buffers()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            got, got_t, pair, amax = cast((blocks, chunks), delayed, bufs)
            torch.cuda.synchronize()
        names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
        # one kernel: no row-order cast copied into place (the fallback's copy)
        assert sum(n.startswith("cast_t") for n in names) == 1, names
        assert not any("copy" in n.lower() for n in names), names
        assert torch.equal(got.view(torch.uint8),
                           f.chunk_major(want, blocks, chunks).view(torch.uint8)), (delayed,)
        assert torch.equal(pair, want_pair) and torch.equal(amax, want_amax)
        if col:
            assert torch.equal(got_t.view(torch.uint8), want_t.view(torch.uint8))
