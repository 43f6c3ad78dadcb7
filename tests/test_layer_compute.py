"""benchmarks/layer_compute.py on CPU: one process emulating a TP rank builds
Megatron's plain TransformerLayer and ours from the same weights, at that TP
size's per-rank dimensions, and both give the same output and grads on the
mirror transport; the check catches a layer or a ring step that differs. Runs in
a fresh process (the benchmark installs megatron-core's CPU shims)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from helpers.dist import run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench():
    spec = importlib.util.spec_from_file_location(
        "layer_compute", os.path.join(ROOT, "benchmarks", "layer_compute.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def _cases(rank: int, world: int, out: str) -> dict:
    import json

    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state

    import megatron_overlap as mo
    from megatron_overlap.ab.emulated_tp import EmulatedTP, MirrorTransport

    bench = _bench()
    all_reduce = dist.all_reduce
    res: dict = {"rc": bench.main(["--shapes", "tiny", "--device", "cpu", "--out", out])}
    with open(os.path.join(out, "layer_compute_cpu.json")) as f:
        res["doc"] = json.load(f)
    res["tp_group_after"] = parallel_state.get_tensor_model_parallel_group().size()
    res["all_reduce_restored"] = dist.all_reduce is all_reduce

    class NoRing(MirrorTransport):
        """A ring step that moves nothing: ours' gathered blocks stay stale."""

        def _start_exchange(self, sends, recvs, op, chunk):
            return super(MirrorTransport, self)._start_exchange(sends, recvs, op, chunk)

    shape = bench.pick_shapes("tiny", 0)[0]
    args = bench.parse_args(["--device", "cpu"])
    device = torch.device("cpu")
    bench.init_process(device, args.seed)
    mo.install(backend="torch_p2p")
    try:
        with EmulatedTP(shape.tp, rank=shape.tp - 1) as emu:
            bench.seed_rng(device, args.seed)
            arms, extras = bench.build_arms(shape, args, torch.float32, device)
            res["weights"] = {a.name: {n: tuple(p.shape) for n, p in a.layer.named_parameters()}
                              for a in arms}
            res["classes"] = {a.name: type(a.layer.mlp.linear_fc1).__name__ for a in arms}
            res["no_ring"] = bench.check(emu, arms, extras, 1e-5, mirror=NoRing)
            with torch.no_grad():
                arms[1].layer.mlp.linear_fc2.weight[0, 0] += 1e-3
            res["other_weight"] = bench.check(emu, arms, extras, 1e-5)
    finally:
        mo.uninstall()
    return res


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    return run(_cases, 1, str(tmp_path_factory.mktemp("layer_compute")), timeout=300)[0]


def test_layer_compute_cpu_ours_equals_megatron(cases):
    res = cases
    assert res["rc"] == 0
    doc = res["doc"]
    assert doc["benchmark"] == "layer_compute" and doc["checks_passed"]
    (row,) = doc["rows"]
    assert row["shape"] == "tiny" and "arms" not in row and "GPU" in row["skipped"]
    c = row["check"]
    assert c["passed"] and c["max_rel_err"] <= 1e-5
    params = set(res["weights"]["megatron"])
    assert {k.removeprefix("grad ") for k in c["rel_err"] if k.startswith("grad ")} == params
    assert {"output", "input grad"} <= set(c["rel_err"])
    # every TP collective of both layers went through the emulation, none elsewhere:
    # Megatron's all-gathers (qkv, fc1 forward and their backward re-gathers; proj, fc2
    # backward) and reduce-scatters (proj, fc2 forward; qkv, fc1 dgrad); ours' passes
    moved = c["transfers"]
    assert moved["megatron"] == {"megatron_all_gather": 6, "megatron_reduce_scatter": 4}
    assert {f"{b}_{p}" for b in ("qkv", "proj", "fc1", "fc2") for p in ("fprop", "dgrad")} \
        <= set(moved["ours"])
    assert not any(op.startswith("megatron_") for op in moved["ours"])
    # the ring all-gathers ran TP - 1 steps
    assert moved["ours"]["qkv_fprop"] == moved["ours"]["fc1_fprop"] == row["tp"] - 1
    # Megatron built both at the emulated rank's dimensions: the per-rank GEMM shapes
    assert res["weights"]["ours"] == res["weights"]["megatron"]
    w = res["weights"]["megatron"]
    linears = {s["buffer"]: (s["n"], s["k"]) for s in row["per_rank_linears"]}
    assert w["self_attention.linear_qkv.weight"] == linears["qkv"]
    assert w["self_attention.linear_proj.weight"] == linears["proj"]
    assert w["mlp.linear_fc1.weight"] == linears["fc1"]
    assert w["mlp.linear_fc2.weight"] == linears["fc2"]
    assert res["classes"] == {"megatron": "ColumnParallelLinear",
                              "ours": "OverlapColumnParallelLinear"}
    # the emulation is undone on exit
    assert res["tp_group_after"] == 1 and res["all_reduce_restored"]


def test_layer_compute_check_catches_what_differs(cases):
    res = cases
    assert not res["no_ring"]["passed"] and res["no_ring"]["rel_err"]["output"] > 1e-3
    bad = res["other_weight"]
    assert not bad["passed"] and bad["rel_err"]["output"] > 1e-5


def _fusions(rank: int, world: int) -> dict:
    import torch
    from megatron.core.fusions import fused_bias_swiglu

    bench = _bench()
    shape = bench.pick_shapes("tiny", 0)[0]
    device = torch.device("cpu")
    bench.init_process(device, 1234)
    calls = []
    swiglu = fused_bias_swiglu.SwiGLUFunction.forward

    def counted(*a, **k):
        calls.append(1)
        return swiglu(*a, **k)

    fused_bias_swiglu.SwiGLUFunction.forward = staticmethod(counted)
    res: dict = {}
    import megatron_overlap as mo
    from megatron_overlap.ab.emulated_tp import EmulatedTP, MirrorTransport

    mo.install(backend="torch_p2p")  # (as the benchmarks build: Megatron's norms under SP)
    try:
        with EmulatedTP(shape.tp, shape.tp - 1, MirrorTransport(shape.tp, shape.tp - 1)):
            layers = {}
            for f in ("off", "megatron_lm"):
                cfg = bench.layer_config(shape, False, torch.float32, device, f)
                res[f] = (cfg.bias_activation_fusion, cfg.bias_dropout_fusion, cfg.apply_rope_fusion)
                bench.seed_rng(device, 1234)
                layers[f] = bench.build_layer(shape, False, torch.float32, device, f)
            layers["megatron_lm"].load_state_dict(layers["off"].state_dict())
            d = shape.dims
            x = torch.randn(d.seq_length // shape.tp, d.micro_batch, d.hidden)
            mask = torch.ones(d.seq_length, d.seq_length).triu(1).bool()[None, None]
            outs = {}
            for f, layer in layers.items():
                before = len(calls)
                outs[f] = layer(x, attention_mask=mask)[0]
                res[f + "_swiglu_calls"] = len(calls) - before
        res["diff"] = (outs["off"] - outs["megatron_lm"]).abs().max().item()
    finally:
        fused_bias_swiglu.SwiGLUFunction.forward = swiglu
        mo.uninstall()
    return res


def test_megatron_lm_fusions_run_megatrons_fused_swiglu_with_the_same_result():
    """--fusions megatron_lm (fp8_layer.py's default) builds the layer Megatron-LM runs for
    a SwiGLU model: megatron-core's fused SwiGLU and dropout-add, RoPE unfused (it needs
    Transformer Engine), and the same result as every op on its own."""
    res = run(_fusions, 1, timeout=300)[0]
    assert res["off"] == (False, False, False)
    assert res["megatron_lm"] == (True, True, False)
    assert res["off_swiglu_calls"] == 0 and res["megatron_lm_swiglu_calls"] == 1
    assert res["diff"] <= 1e-5


def _attention_layer(rank: int, world: int, out: str, layers: int, *more: str) -> dict:
    import json

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import attention_layer
    import torch

    cpu = torch.device("cpu")
    res: dict = {"rc": attention_layer.main(["--shapes", "tiny", "--device", "cpu", "--out", out,
                                             "--fusions", "megatron_lm", "--layers", str(layers),
                                             *more])}
    with open(os.path.join(out, "attention_layer_cpu.json")) as f:
        res["doc"] = json.load(f)
    shape = attention_layer.shape_of("tiny", layers)
    if more:  # --streams-arm N: each arm's overlapped linears' settings, pass by pass
        for arm in ("ours", f"ours_streams{more[-1]}"):
            layer = attention_layer.build(shape, arm, torch.float32, cpu, "off")
            res[arm] = sorted((name, p, getattr(m.overlap_plan, p).gemm_streams)
                              for name, m in (("qkv", layer.self_attention.linear_qkv),
                                              ("fc2", layer.mlp.linear_fc2))
                              for p in ("fprop", "dgrad", "wgrad") if getattr(m.overlap_plan, p) is not None
                              and getattr(m.overlap_plan, p).method != "external")
    elif layers == 1:
        for fusions in ("off", "megatron_lm"):
            c = attention_layer.build(shape, "ours", torch.float32, cpu, fusions).config
            res[fusions] = (c.bias_activation_fusion, c.bias_dropout_fusion)
    else:
        stack = attention_layer.build(shape, "ours", torch.float32, cpu, "off")
        res["linears"] = sorted({type(m).__module__.split(".")[0] for layer in stack.layers
                                 for m in (layer.self_attention.linear_qkv, layer.mlp.linear_fc2)})
        res["numbers"] = [layer.layer_number for layer in stack.layers]
    return res


def test_attention_layer_cpu_builds_its_arms_and_checks_them(tmp_path):
    """benchmarks/attention_layer.py on CPU at the tiny shape: its four arms built (with
    Megatron-LM's fusions), each with the core attention class it names, every arm within
    fp32's bound of Megatron's layer (timing and memory need a GPU); --fusions reaches the
    layers' config."""
    res = run(_attention_layer, 1, str(tmp_path), 1, timeout=300)[0]
    assert res["rc"] == 0
    assert res["off"] == (False, False) and res["megatron_lm"] == (True, True)
    (row,) = res["doc"]["rows"]
    assert row["attention"] == {"megatron": "DotProductAttention", "sdpa_ref": "SDPAReference",
                                "ours_attention": "TorchDotProductAttention",
                                "ours": "TorchDotProductAttention"}
    assert res["doc"]["checks_passed"] and "GPU" in row["skipped"]


def test_attention_layer_cpu_runs_ours_on_other_streams_beside_ours(tmp_path):
    """--streams-arm 1: a fifth arm, ours_streams1 (before ours, which stays last), whose
    overlapped linears' ring and pipeline passes take gemm_streams 1 where ours' take 0
    (install()'s default, 3 streams), checked against Megatron's layer like every arm."""
    res = run(_attention_layer, 1, str(tmp_path), 1, "--streams-arm", "1", timeout=300)[0]
    assert res["rc"] == 0 and res["doc"]["checks_passed"]
    (row,) = res["doc"]["rows"]
    assert list(row["attention"]) == ["megatron", "sdpa_ref", "ours_attention", "ours_streams1", "ours"]
    assert row["check"]["max_rel_err"]["ours_streams1"] <= 1e-5
    # fc2: a pipelined forward, a ring dgrad; qkv (built here without SP): a bulk wgrad,
    # no chunk GEMMs, so its key stays the default
    assert res["ours"] == [("fc2", "dgrad", 0), ("fc2", "fprop", 0), ("qkv", "wgrad", 0)]
    assert res["ours_streams1"] == [("fc2", "dgrad", 1), ("fc2", "fprop", 1), ("qkv", "wgrad", 0)]


def test_attention_layer_cpu_stacks_layers(tmp_path):
    """--layers 2: every arm a stack of two layers (numbered 1 and 2, ours' linears ours in
    both), checked against Megatron's stack through every parameter of both layers."""
    res = run(_attention_layer, 1, str(tmp_path), 2, timeout=300)[0]
    assert res["rc"] == 0 and res["doc"]["checks_passed"]
    (row,) = res["doc"]["rows"]
    assert row["dims"]["layers"] == 2
    errs = row["check"]["rel_err"]["ours"]
    assert {"grad layers.0.mlp.linear_fc2.weight", "grad layers.1.mlp.linear_fc2.weight",
            "grad layers.1.self_attention.linear_qkv.weight", "input grad"} <= set(errs)
    assert res["numbers"] == [1, 2] and res["linears"] == ["megatron_overlap"]


def test_probe_layer_graph_parses_every_option_the_arms_it_builds_read():
    """benchmarks/probe_layer_graph.py builds attention_layer's arms (`build_arms`, the
    `arms_of` it calls, and layer_compute's `last_rank` around it) from its own command
    line: every `args.<name>` and `getattr(args, "<name>")` those read must be one of its
    options (a missing one stopped the probe at its first build)."""
    import ast
    import inspect

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import attention_layer
    import layer_compute
    import probe_layer_graph

    read = set()
    for fn in (attention_layer.build_arms, attention_layer.arms_of, layer_compute.last_rank):
        for node in ast.walk(ast.parse(inspect.getsource(fn).lstrip())):
            if isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "args":
                read.add(node.attr)
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr"
                    and getattr(node.args[0], "id", None) == "args"):
                read.add(node.args[1].value)
    assert {"fusions", "ub_cfgs", "seed", "streams_arm"} <= read
    parsed = vars(probe_layer_graph.parser().parse_args([]))
    assert read <= set(parsed), sorted(read - set(parsed))
    assert parsed["fusions"] == "off" and parsed["ub_cfgs"] is None  # attention_layer's defaults
