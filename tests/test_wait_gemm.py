"""The ring all-gather with one waiting GEMM (`overlap.ag_gemm.ring_waiting`, the
`wait_gemm` key) on CPU: its transfers and flags against the plain ring's results on gloo
ranks, in bf16-free fp32 and in FP8; where it refuses to run and says so; the key in the
settings. The kernel itself runs on a GPU only (tests/gpu/test_wait_gemm_gpu.py); on CPU
the launch checks every block was flagged, then multiplies through the pass's GEMM."""

from __future__ import annotations

import logging

import pytest
import torch

from helpers import dist


def _rings(rank: int, world: int) -> dict:
    import torch.distributed as tdist

    from megatron_overlap.ab.compare import rel_error
    from megatron_overlap.comm import TorchP2PTransport, trace
    from megatron_overlap.layers.fp8 import quantized
    from megatron_overlap.overlap.ag_gemm import ring_exchange, ring_waiting
    from megatron_overlap.overlap.fp8 import ScaledGemm

    tdist.init_process_group("gloo", rank=rank, world_size=world)
    tp = TorchP2PTransport(tdist.group.WORLD)
    g = torch.Generator().manual_seed(3)
    x_full = torch.randn(world * 8, 16, generator=g)
    w = torch.randn(16, 16, generator=g)
    x = x_full[rank * 8:(rank + 1) * 8]
    res: dict = {}
    for aggregate in ((False, True) if world > 2 else (False,)):
        tp.begin_pass("ag")
        with trace.recording() as ev:
            y, gathered = ring_waiting(x, w, tp, op="ag", aggregate=aggregate)
        kinds = [e.kind for e in ev]
        res[f"fp32_{aggregate}"] = {
            "err": max(rel_error(y, x_full @ w.t()), rel_error(gathered, x_full)),
            "gemms": kinds.count("gemm"),
            "starts_before_gemm": kinds.index("gemm") > max(i for i, k in enumerate(kinds) if k == "start"),
        }
    # FP8 operands (per-tensor scales): bit-equal to one whole scaled GEMM, as the ring's is
    xq, xs, _ = quantized(x_full, torch.float8_e4m3fn)
    wq, ws, _ = quantized(w, torch.float8_e4m3fn)
    gemm = ScaledGemm(xs, ws, torch.float32, fast_accum=False)
    whole = gemm(xq, wq.t(), op="whole")
    tp.begin_pass("ag8")
    y8, _ = ring_waiting(xq[rank * 8:(rank + 1) * 8], wq, tp, op="ag8", gemm=gemm)
    tp.begin_pass("ag8_ring")
    y8_ring, _ = ring_exchange(xq[rank * 8:(rank + 1) * 8], wq, tp, op="ag8_ring", gemm=gemm)
    res["fp8"] = {"dtype": str(y8.dtype), "equal_whole": bool(torch.equal(y8, whole)),
                  "equal_ring": bool(torch.equal(y8, y8_ring))}
    tdist.destroy_process_group()
    return res


@pytest.fixture(scope="module", params=[2, 4])
def rings(request) -> list[dict]:
    return dist.run(_rings, request.param, timeout=120)


def test_the_waiting_ring_gathers_and_multiplies_as_the_ring(rings):
    for res in rings:
        for key in ("fp32_False", "fp32_True"):
            if key not in res:
                continue
            assert res[key]["err"] < 1e-6, (key, res[key])
            assert res[key]["gemms"] == 1, res[key]  # one GEMM over the whole input
            assert res[key]["starts_before_gemm"], res[key]  # every transfer issued first
        assert res["fp8"] == {"dtype": "torch.float32", "equal_whole": True, "equal_ring": True}


def test_a_block_never_flagged_is_refused_before_the_gemm():
    from megatron_overlap.overlap import wait_gemm

    a, wt, out = torch.randn(8, 4), torch.randn(4, 3), torch.empty(8, 3)
    ready = torch.tensor([1, 0, 1, 0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"qkv_fprop: .*block\(s\) \[1, 3\] never flagged"):
        wait_gemm.launch(a, wt, out, ready, torch.arange(4, dtype=torch.int32), 2,
                         wait_gemm.matmul, op="qkv_fprop", timeout_s=1.0)


def test_where_it_cannot_run_the_ring_runs_and_says_why(caplog):
    """On a transport whose transfers need SMs (NCCL's, here torch_p2p's class) the ring's
    chunk GEMMs run, with a warning naming the pass and the reason; on null, one GEMM."""
    from megatron_overlap.comm import NullTransport, trace
    from megatron_overlap.comm.torch_p2p import TorchP2PTransport
    from megatron_overlap.overlap import all_gather_matmul

    class P2P(NullTransport):  # torch_p2p's capabilities, null's (absent) transfers
        name = "torch_p2p"
        why_no_wait = TorchP2PTransport.why_no_wait

    from megatron_overlap.overlap import wait_gemm

    wait_gemm._warned.clear()  # (said once per process: this test's own messages)
    x, w = torch.randn(4, 8), torch.randn(6, 8)
    for tp, gemms in ((NullTransport(4, 1), 1), (P2P(4, 1), 4)):
        with caplog.at_level(logging.WARNING, logger="megatron_overlap"), trace.recording() as ev:
            all_gather_matmul(x, w, tp, "ring_exchange", op=f"fc1_fprop_{tp.name}", wait=True)
        assert [e.kind for e in ev].count("gemm") == gemms, tp.name
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "fc1_fprop_torch_p2p" in warned[0] and "NCCL" in warned[0], warned
    assert "set wait_gemm: false" in warned[0]  # the fix, named
    assert wait_gemm.fell_back() == {("fc1_fprop_torch_p2p", P2P(4, 1).why_no_wait)}
    # across nodes the hierarchical order runs, and a strided output takes the chunk GEMMs
    for op, kw in (("nodes", dict(nodes=[[0, 1], [2, 3]])),
                   ("strided", dict(out=torch.empty(8, 16)[:, ::2]))):
        with trace.recording() as ev:
            all_gather_matmul(x, w, NullTransport(4, 1), "ring_exchange", op=op, wait=True, **kw)
        assert [e.kind for e in ev].count("gemm") > 1, op
    assert {op for op, _ in wait_gemm.fell_back()} >= {"nodes", "strided"}


def test_the_key_in_settings_and_the_table():
    from megatron_overlap.config.effects import ACTIVE, layer_effects
    from megatron_overlap.config.loading import parse

    settings, _ = parse({"qkv_fprop": {"method": "ring_exchange", "wait_gemm": True},
                         "proj_fprop": {"method": "pipeline", "wait_gemm": 1}}, rs_dgrad=False)
    assert settings["qkv_fprop"].wait_gemm is True and settings["proj_fprop"].wait_gemm is True
    assert settings["fc1_fprop"].wait_gemm is False  # the default
    waiting = layer_effects(settings["qkv_fprop"], "symm")
    assert waiting["wait_gemm"] == ACTIVE
    # its one GEMM runs on the pass's stream: the chunk GEMMs' stream keys do nothing
    assert waiting["gemm_streams"].startswith("no effect") and waiting["gemm_priority"].startswith("no effect")
    assert layer_effects(settings["qkv_fprop"], "torch_p2p")["wait_gemm"].startswith("fallback")
    assert layer_effects(settings["proj_fprop"], "symm")["wait_gemm"].startswith("no effect")
    # off (the default): active where it could run, no effect (not a fallback) where not
    off = layer_effects(settings["fc1_fprop"], "torch_p2p")
    assert off["wait_gemm"].startswith("no effect on torch_p2p") and off["gemm_streams"] == ACTIVE
    assert layer_effects(settings["fc1_fprop"], "symm")["wait_gemm"] == ACTIVE
    with pytest.raises(Exception, match="wait_gemm"):
        parse({"qkv_fprop": {"wait_gemm": "yes"}}, rs_dgrad=False)


def _layer(rank: int, world: int, cfgs: str) -> dict:
    """benchmarks/layer_compute.py's check (ours against Megatron's TransformerLayer on the
    mirror transport, output and every grad) with every ring all-gather waiting."""
    import importlib.util
    import os
    import sys

    import megatron_overlap as mo
    from megatron_overlap.ab.emulated_tp import EmulatedTP, MirrorTransport
    from megatron_overlap.comm import trace

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("layer_compute", os.path.join(root, "benchmarks",
                                                                                "layer_compute.py"))
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)

    class NoRing(MirrorTransport):
        """A ring step that moves nothing: the gathered blocks stay stale."""

        def _start_exchange(self, sends, recvs, op, chunk):
            return super(MirrorTransport, self)._start_exchange(sends, recvs, op, chunk)

    shape = bench.pick_shapes("tiny", 0)[0]
    args = bench.parse_args(["--device", "cpu", "--ub-cfgs", cfgs])
    device = torch.device("cpu")
    bench.init_process(device, args.seed)
    mo.install(ub_cfgs=args.ub_cfgs, backend="torch_p2p")
    res: dict = {"tp": shape.tp}
    try:
        with EmulatedTP(shape.tp, rank=shape.tp - 1) as emu:
            bench.seed_rng(device, args.seed)
            arms, extras = bench.build_arms(shape, args, torch.float32, device)
            with trace.recording() as ev:
                res["check"] = bench.check(emu, arms, extras, 1e-5)
            res["gemms"] = {op: (sum(1 for e in ev if e.kind == "gemm" and e.op == op),
                                 sum(1 for e in ev if e.kind == "start" and e.op == op and e.chunk == 1))
                            for op in {e.op for e in ev}}
            res["no_ring"] = bench.check(emu, arms, extras, 1e-5, mirror=NoRing)
    finally:
        mo.uninstall()
    return res


def test_a_layer_with_waiting_rings_equals_megatrons():
    """Every ring all-gather of a transformer layer waiting (benchmarks/configs/
    wait_gemm.yaml): ours equals Megatron's layer; with transfers that move nothing it
    does not (the check sees the rings); each waiting pass ran one GEMM."""
    import os

    cfgs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "benchmarks", "configs", "wait_gemm.yaml")
    res = dist.run(_layer, 1, cfgs, timeout=300)[0]
    assert res["check"]["passed"], res["check"]
    assert not res["no_ring"]["passed"], res["no_ring"]
    # (GEMMs, ring calls) per pass: a waiting ring's call runs one GEMM, not one per block
    waiting = {op: n for op, n in res["gemms"].items()
               if any(k in op for k in ("qkv_fprop", "fc1_fprop", "proj_dgrad", "fc2_dgrad"))}
    assert len(waiting) == 4 and all(g == calls > 0 for g, calls in waiting.values()), res["gemms"]


def test_the_tile_config_and_what_the_kernel_refuses():
    """`config`: whole tiles or None, and the tile that fills the last wave best (70B's qkv
    N 1280: the 128-wide FP8 tile; proj dgrad N 1024: the 256-wide); `why_not`: a GEMM seam
    it does not take, and offsets past int32."""
    from megatron_overlap.overlap import wait_gemm
    from megatron_overlap.overlap.fp8 import RowScaledGemm

    e4m3 = torch.float8_e4m3fn
    assert wait_gemm.config(e4m3, 1024, 1280, 8192, 8192, 131)[:3] == (128, 128, 128)
    assert wait_gemm.config(e4m3, 1024, 1024, 8192, 8192, 131)[:3] == (128, 256, 128)
    assert wait_gemm.config(torch.bfloat16, 1024, 1152, 8192)[:3] == (128, 128, 64)  # 256 no divisor
    assert wait_gemm.config(torch.bfloat16, 96, 1024, 8192) is None  # 96 rows a block
    x, wt = torch.randn(4, 8), torch.randn(8, 6)
    assert wait_gemm.why_not(x, wt, wait_gemm.matmul, "", 4, 2) is None
    assert "RowScaledGemm" in wait_gemm.why_not(x, wt, RowScaledGemm.__new__(RowScaledGemm), "", 4, 2)
    big = torch.empty(1).expand(2 ** 16, 2 ** 15)  # (one element: only the shapes are read)
    assert "int32" in wait_gemm.why_not(big, torch.empty(1).expand(2 ** 15, 8), wait_gemm.matmul, "",
                                        2 ** 16, 2)
    assert wait_gemm.why_not(x, wt, wait_gemm.matmul, "null: no", 4, 2) == "null: no"
