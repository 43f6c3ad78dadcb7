"""Telemetry on real overlapped layers in this process (one gloo rank, TP=1): the
per-pass rows, the console table, and an offline wandb run read back from disk."""

import os
import socket

import pytest
import torch

HIDDEN, FFN, SEQ, BATCH = 16, 32, 4, 2
UB_CFGS = {"proj_fprop": {"method": "pipeline", "num_splits": 2}}
MODULES = ["decoder.layers.0.self_attention.linear_qkv", "decoder.layers.0.self_attention.linear_proj",
           "decoder.layers.1.mlp.linear_fc1", "decoder.layers.1.mlp.linear_fc2"]
# TP=1, no SP: column layers hide the dgrad all-reduce under wgrad, row layers
# all-reduce their output in chunks under the fprop GEMM.
# Sorted by layer number, then module path (linear_proj before linear_qkv), then pass.
EXPECTED = [(0, MODULES[1], "fprop", "proj_fprop"), (0, MODULES[0], "wgrad", "qkv_wgrad"),
            (1, MODULES[2], "wgrad", "fc1_wgrad"), (1, MODULES[3], "fprop", "fc2_fprop")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Wrapper(torch.nn.Module):
    """Stands in for Megatron's DDP / Float16Module: the model under `.module`."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def _build_model():
    from megatron.core import ModelParallelConfig

    from megatron_overlap.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear

    def cfg(overlap=True):
        return ModelParallelConfig(tensor_model_parallel_size=1, use_cpu_initialization=True,
                                   tp_comm_overlap=overlap)

    init = torch.nn.init.xavier_normal_
    col = lambda i, o, buf, name, overlap=True: OverlapColumnParallelLinear(  # noqa: E731
        i, o, config=cfg(overlap), init_method=init, bias=True, gather_output=False,
        tp_comm_buffer_name=buf, name=name)
    row = lambda i, o, buf, name: OverlapRowParallelLinear(  # noqa: E731
        i, o, config=cfg(), init_method=init, bias=True, input_is_parallel=True,
        skip_bias_add=False, tp_comm_buffer_name=buf, name=name)
    mod = torch.nn.Module
    attn, mlp, l0, l1, dec, gpt = mod(), mod(), mod(), mod(), mod(), mod()
    attn.linear_qkv = col(HIDDEN, 3 * HIDDEN, "qkv", MODULES[0])
    attn.linear_proj = row(HIDDEN, HIDDEN, "proj", MODULES[1])
    mlp.linear_fc1 = col(HIDDEN, FFN, "fc1", MODULES[2])
    mlp.linear_fc2 = row(FFN, HIDDEN, "fc2", MODULES[3])
    l0.self_attention, l1.mlp = attn, mlp
    dec.layers = torch.nn.ModuleList([l0, l1])
    gpt.decoder = dec
    # an overlapped class whose plan is off (tp_comm_overlap=False): not a row
    gpt.output_layer = col(HIDDEN, 8, "fc1", "output_layer", overlap=False)
    return gpt


def _train_step(gpt, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=g, requires_grad=True)
    attn, mlp = gpt.decoder.layers[0].self_attention, gpt.decoder.layers[1].mlp
    h, _ = attn.linear_qkv(x)
    h, _ = attn.linear_proj(h[..., :HIDDEN])
    h, _ = mlp.linear_fc1(h)
    h, _ = mlp.linear_fc2(h)
    y, _ = gpt.output_layer(h)
    loss = y.square().mean()
    loss.backward()
    return loss.item()


@pytest.fixture(scope="module")
def model():
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    import megatron_overlap as mo
    from helpers.megatron_cpu import init

    # the CPU shims patch torch.cuda and Megatron's RNG tracker: put them back after
    saved_cuda = {k: getattr(torch.cuda, k) for k in ("current_device", "synchronize", "device_count")}
    saved_rng = (mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                     "MASTER_PORT": str(_free_port())}.items():
            mp.setenv(k, v)
        init(1)
        mo.install(ub_cfgs=UB_CFGS)
        try:
            gpt = _build_model()
            _train_step(gpt, seed=0)  # buffer sizes are known after the first forward
            yield gpt
        finally:
            mo.uninstall()
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
            for k, v in saved_cuda.items():
                setattr(torch.cuda, k, v)
            mrandom._CUDA_RNG_STATE_TRACKER, mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = saved_rng


def test_layer_settings_rows(model):
    from megatron_overlap.telemetry import layer_settings

    rows = layer_settings(model)
    assert [(r["layer_number"], r["module"], r["pass"], r["settings"]) for r in rows] == EXPECTED
    for r in rows:
        assert r["buffer_bytes"] > 0, r
        assert r["backend"] == "torch_p2p"
        assert {"method", "num_splits", "num_sm", "use_ce", "aggregate", "no_effect", "layer"} <= set(r)
    proj = rows[0]
    assert (proj["method"], proj["num_splits"]) == ("pipeline", 2)  # from UB_CFGS
    assert proj["layer"] == MODULES[1]  # the `name` keyword
    # fp32 tokens x width: proj's output (row) is HIDDEN wide, fc1's input HIDDEN
    assert proj["buffer_bytes"] == SEQ * BATCH * HIDDEN * 4


def test_layer_settings_strips_wrappers(model):
    from megatron_overlap.telemetry import layer_settings

    bare = layer_settings(model)
    wrapped = layer_settings(_Wrapper(_Wrapper(model)))  # DDP(Float16Module(model))
    assert wrapped == bare
    assert not any(r["module"].startswith("module.") for r in wrapped)


def test_layer_settings_order_and_numbers():
    """Numeric layer order (10 after 2), fprop/dgrad/wgrad order, -1 outside layers."""
    from megatron_overlap.telemetry import layer_settings
    from megatron_overlap.telemetry.rows import layer_number

    class Fake(torch.nn.Module):
        def __init__(self, passes, enabled=True):
            super().__init__()
            self.passes = passes
            self.overlap_plan = type("Plan", (), {"enabled": enabled})()

        def overlap_rows(self):
            return [{"pass": p, "layer": "x"} for p in self.passes]

    root = torch.nn.Module()
    root.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(11)])
    root.layers[10].fc = Fake(["wgrad", "fprop", "dgrad"])
    root.layers[2].fc = Fake(["dgrad"])
    root.layers[3].fc = Fake(["fprop"], enabled=False)
    root.head = Fake(["fprop"])
    got = [(r["layer_number"], r["module"], r["pass"]) for r in layer_settings(root)]
    assert got == [(-1, "head", "fprop"), (2, "layers.2.fc", "dgrad"), (10, "layers.10.fc", "fprop"),
                   (10, "layers.10.fc", "dgrad"), (10, "layers.10.fc", "wgrad")]
    assert layer_number("module.decoder.layers.31.mlp.linear_fc1") == 31
    assert layer_number("output_layer") == -1
    assert layer_number("decoder.final_layers.3.x") == -1


def test_console_table(model, capsys):
    from megatron_overlap.telemetry import OverlapTelemetry, settings_table
    from megatron_overlap.telemetry.table import human_bytes

    rows = OverlapTelemetry(None).log_settings(model)
    out = capsys.readouterr().out
    assert len(rows) == 4
    for m in MODULES:
        assert m in out
    assert "output_layer" not in out
    assert "pipeline" in out and "torch_p2p" in out
    assert out.count("512 B") == 4  # each buffer: 8 tokens x 16 x fp32, human readable
    assert max(map(len, out.splitlines())) <= 160
    assert OverlapTelemetry(None, console=False).log_settings(model) == rows
    assert capsys.readouterr().out == ""
    assert "no overlapped layers" in settings_table([])
    assert [human_bytes(n) for n in (0, 1536, 3 * 2**30)] == ["0 B", "1.5 KiB", "3.0 GiB"]


def test_log_step_without_run(model):
    from megatron_overlap.comm import stats
    from megatron_overlap.telemetry import OverlapTelemetry

    tel = OverlapTelemetry(None, prefix="ov")
    tel.log_step(0)  # drops what earlier steps left
    _train_step(model, seed=5)
    snap = stats.snapshot(reset=False)
    m = tel.log_step(1, {"loss": 1.5})
    assert snap, "a forward+backward through overlapped layers records transfers"
    assert m["loss"] == 1.5
    for op, s in snap.items():
        assert m[f"ov/{op}/transfers"] == s["transfers"] > 0
        assert m[f"ov/{op}/bytes"] == s["bytes"]
        assert m[f"ov/{op}/wait_ms"] == pytest.approx(s["wait_s"] * 1e3)
    assert m["ov/bytes_total"] == sum(s["bytes"] for s in snap.values()) > 0
    # how the passes ran: each of the four overlapped layers ran its forward and its backward
    # pass once (the output layer, overlapping nothing, runs Megatron's path: no pass); none
    # replayed (CPU: no CUDA graphs)
    assert (m["ov/replay/calls"], m["ov/replay/replays"], m["ov/replay/captures"]) == \
        (2 * len(MODULES), 0, 0)
    assert m["ov/replay/replayed"] == 0.0
    assert tel.log_step(2) == {"ov/wait_ms_total": 0.0, "ov/bytes_total": 0, "ov/replay/calls": 0,
                               "ov/replay/replays": 0, "ov/replay/captures": 0,
                               "ov/replay/evictions": 0}  # counters were reset


def test_wandb_offline_round_trip(model, tmp_path, monkeypatch):
    import wandb

    from megatron_overlap.telemetry import (OverlapTelemetry, layer_settings, read_offline_run,
                                            wait_for_exit)

    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = wandb.init(mode="offline", dir=tmp_path, project="test", group="g",
                     settings=wandb.Settings(console="off", x_disable_stats=True, disable_git=True,
                                             save_code=False))
    try:
        tel = OverlapTelemetry(run, console=False)
        rows = tel.log_settings(model)
        logged = []
        for step in range(3):
            loss = _train_step(model, seed=10 + step)
            logged.append(tel.log_step(step, {"loss": loss}))
    finally:
        run.finish()

    wait_for_exit(run.dir)
    got = read_offline_run(run.dir)
    assert read_offline_run(str(tmp_path))["history"] == got["history"]  # the wandb.init dir works too

    cfg = got["config"]["megatron_overlap"]
    assert sorted(cfg["layers"]) == sorted(f"{m}/{p}" for _, m, p, _ in EXPECTED)
    proj = cfg["layers"][f"{MODULES[1]}/fprop"]
    assert proj == {k: rows[0][k] for k in ("method", "num_splits", "num_sm", "use_ce", "aggregate",
                                            "backend", "ring_order", "transport", "buffer_bytes")}
    assert (proj["method"], proj["num_splits"]) == ("pipeline", 2)
    assert cfg["ub_cfgs"]["proj_fprop"]["num_splits"] == 2
    assert cfg["ub_cfgs"]["fc1_fprop"]["method"] == "ring_exchange"  # TE's default, filled in
    assert cfg["backend"] == "torch_p2p"

    table = got["tables"]["overlap/settings"]
    assert len(table) == len(layer_settings(model)) == 4
    assert [(t["module"], t["pass"], t["num_splits"]) for t in table] == \
        [(r["module"], r["pass"], r["num_splits"]) for r in rows]

    history = got["history"]
    assert [h["_step"] for h in history] == [0, 1, 2]
    for h, m in zip(history, logged):
        assert m["overlap/bytes_total"] > 0
        assert any(k.endswith("/wait_ms") for k in m)
        for k, v in m.items():
            assert h[k] == pytest.approx(v), k
        assert h["loss"] == m["loss"]


def test_read_offline_run_torn_tail(tmp_path, monkeypatch):
    """A run killed mid-write: every whole record before the tear still reads."""
    import wandb

    from megatron_overlap.telemetry import read_offline_run, wait_for_exit

    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))
    run = wandb.init(mode="offline", dir=tmp_path / "run", project="test",
                     settings=wandb.Settings(console="off", x_disable_stats=True, disable_git=True))
    for step in range(5):
        run.log({"x": step * 1.5}, step=step)
    run.finish()
    wait_for_exit(run.dir)
    folder = os.path.dirname(run.dir)
    log = os.path.join(folder, next(f for f in os.listdir(folder) if f.endswith(".wandb")))
    full = read_offline_run(folder)["history"]
    assert [h["x"] for h in full] == [0, 1.5, 3.0, 4.5, 6.0]
    with open(log, "rb") as f:
        data = f.read()
    lengths = []
    for cut in range(0, len(data), 61):
        torn_dir = tmp_path / f"torn{cut}"
        torn_dir.mkdir()
        (torn_dir / os.path.basename(log)).write_bytes(data[:cut])
        torn = read_offline_run(str(torn_dir))["history"]
        assert torn == full[:len(torn)]
        lengths.append(len(torn))
    assert lengths == sorted(lengths) and 0 < len(set(lengths) - {0, 5})
