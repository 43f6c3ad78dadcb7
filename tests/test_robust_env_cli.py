"""Environment variables, CLI flags and input files: a value that cannot be used is
refused where it is read, with a message that names the variable / flag / file,
the value and what is allowed. Nothing is silently taken."""

import json
import math

import pytest

from megatron_overlap.config import env as envvars
from megatron_overlap.cli import main

# -- environment variables -----------------------------------------------------------------

BAD_TIMEOUTS = ["0", "-1", "-0.5", "nan", "inf", "-inf", "1e400", "abc", "5s", "1e9"]


@pytest.mark.parametrize("value", BAD_TIMEOUTS)
def test_unusable_timeout_is_refused_naming_variable_and_value(monkeypatch, value):
    monkeypatch.setenv("MEGATRON_OVERLAP_TIMEOUT_S", value)
    with pytest.raises(envvars.EnvError) as e:
        envvars.timeout_s()
    msg = str(e.value)
    assert f"MEGATRON_OVERLAP_TIMEOUT_S={value!r}" in msg
    assert "> 0" in msg and "inf are refused" in msg


@pytest.mark.parametrize("value,want", [("5", 5.0), (" 2.5 ", 2.5), ("1e3", 1000.0),
                                        ("", 300.0), ("   ", 300.0)])
def test_usable_timeouts_and_empty_means_default(monkeypatch, value, want):
    monkeypatch.setenv("MEGATRON_OVERLAP_TIMEOUT_S", value)
    assert envvars.timeout_s() == want


def test_transport_timeout_comes_from_the_checked_reader(monkeypatch):
    from megatron_overlap.comm.transport import default_timeout

    monkeypatch.setenv("MEGATRON_OVERLAP_TIMEOUT_S", "7.5")
    assert default_timeout().total_seconds() == 7.5
    monkeypatch.setenv("MEGATRON_OVERLAP_TIMEOUT_S", "-3")
    with pytest.raises(envvars.EnvError, match="MEGATRON_OVERLAP_TIMEOUT_S='-3'"):
        default_timeout()


@pytest.mark.parametrize("value", ["0", "-2", "1.5", "two", "33", "1e2"])
def test_unusable_gemm_streams_is_refused(monkeypatch, value):
    from megatron_overlap.overlap.streams import ChunkStreams

    monkeypatch.setenv("MEGATRON_OVERLAP_GEMM_STREAMS", value)
    with pytest.raises(envvars.EnvError) as e:
        ChunkStreams()
    assert f"MEGATRON_OVERLAP_GEMM_STREAMS={value!r}" in str(e.value)
    assert "an integer >= 1 and <= 8" in str(e.value)


def test_gemm_streams_read(monkeypatch):
    from megatron_overlap.config.names import DEFAULT_GEMM_STREAMS
    from megatron_overlap.overlap.streams import ChunkStreams

    monkeypatch.setenv("MEGATRON_OVERLAP_GEMM_STREAMS", "2")
    assert ChunkStreams().n == 2
    monkeypatch.delenv("MEGATRON_OVERLAP_GEMM_STREAMS")
    assert ChunkStreams().n == DEFAULT_GEMM_STREAMS == 3  # Transformer Engine's


@pytest.mark.parametrize("value", ["symm", "NCCL", "torch-p2p", "auto"])
def test_unknown_inter_backend_is_refused(monkeypatch, value):
    from megatron_overlap import comm

    monkeypatch.setenv("MEGATRON_OVERLAP_INTER_BACKEND", value)
    with pytest.raises(envvars.EnvError) as e:
        comm.inter_backend()
    assert f"MEGATRON_OVERLAP_INTER_BACKEND={value!r}" in str(e.value)
    assert "torch_p2p | nvshmem" in str(e.value)


@pytest.mark.parametrize("value", ["0", "-4", "two"])
def test_unusable_local_world_size_is_refused(monkeypatch, value):
    from megatron_overlap.comm.topology import node_key

    monkeypatch.setenv("LOCAL_WORLD_SIZE", value)
    with pytest.raises(envvars.EnvError, match=f"LOCAL_WORLD_SIZE={value!r}.*integer >= 1"):
        node_key(3)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert node_key(3) == "node1"


@pytest.mark.parametrize("var,value", [("MEGATRON_OVERLAP_TIMEOUT_S", "0"),
                                       ("MEGATRON_OVERLAP_GEMM_STREAMS", "0"),
                                       ("MEGATRON_OVERLAP_INTER_BACKEND", "ib")])
def test_install_fails_on_a_bad_variable_naming_it(monkeypatch, var, value):
    import megatron_overlap as mo

    monkeypatch.setenv(var, value)
    with pytest.raises(envvars.EnvError, match=f"{var}={value!r}"):
        mo.install()
    import importlib

    assert not importlib.import_module("megatron_overlap.megatron.install")._previous  # nothing installed


# -- CLI flags -------------------------------------------------------------------------------

def _refused(argv, capsys) -> str:
    """The command is refused (exit status 2, from argparse or from main); its stderr."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    assert rc == 2, f"{argv} accepted"
    return capsys.readouterr().err


@pytest.mark.parametrize("argv,says", [
    (["simulate", "--tp", "0"], "argument --tp: expected an integer >= 1, got '0'"),
    (["simulate", "--tp", "two"], "argument --tp: expected an integer >= 1, got 'two'"),
    (["simulate", "--tp", "8", "--gpus-per-node", "-8"], "argument --gpus-per-node: expected"),
    (["simulate", "--tp", "8", "--micro-batches", "-1"], "argument --micro-batches: expected an "
                                                         "integer >= 1, got '-1'"),
    (["simulate", "--tp", "8", "--layers", "70B=0"], "argument --layers: '70B=0': N expected"),
    (["simulate", "--tp", "8", "--layers", "70B"], "argument --layers: expected MODEL=N"),
    (["simulate", "--tp", "12", "--gpus-per-node", "8"], "--tp 12 with --gpus-per-node 8: a TP "
                                                         "group that spans nodes must fill"),
    (["simulate", "--tp", "8", "--hw", "ib_gbs=-5"], "--hw 'ib_gbs=-5': ib_gbs must be a finite "
                                                     "number > 0"),
    (["simulate", "--tp", "8", "--hw", "nvlink_gbs=nan"], "--hw 'nvlink_gbs=nan'"),
    (["simulate", "--tp", "8", "--hw", "sms=many"], "--hw 'sms=many': sms must be an integer > 0"),
    (["simulate", "--tp", "8", "--hw", "gemm_efficiency=1.5"], "gemm_efficiency must be a finite "
                                                               "number > 0 and <= 1"),
    (["simulate", "--tp", "8", "--hw", "kernel_us=-1"], "kernel_us must be a finite number >= 0"),
    (["simulate", "--tp", "2", "--shapes", "X_qkv=7x64x64"], "--shapes 'X_qkv=7x64x64': shape "
                                                             "'X_qkv=7x64x64': M=7 tokens do not split"),
    (["simulate", "--tp", "3", "--shapes", "70b"], "--shapes '70b': 70B: "),
    (["simulate", "--tp", "8", "--shapes", "bogus"], "--shapes 'bogus'"),
    (["tune", "--model", "70b", "--tp", "8", "--num-query-groups", "5"],
     "--num-query-groups (5) must divide --model 70b's num-attention-heads (64)"),
    (["tune", "--model", "8b", "--tp", "16", "--gpus-per-node", "16"],
     "--model 8b's num-query-groups (8) must be a multiple of --tp 16"),
    (["tune", "--hidden-size", "100", "--ffn-hidden-size", "64", "--num-attention-heads", "8",
      "--tp", "2"], "--num-attention-heads (8) must divide --hidden-size (100)"),
    (["tune", "--hidden-size", "64", "--ffn-hidden-size", "30", "--num-attention-heads", "4",
      "--tp", "4"], "--ffn-hidden-size (30) must be a multiple of --tp 4"),
    (["tune", "--hidden-size", "64", "--ffn-hidden-size", "32", "--num-attention-heads", "6",
      "--tp", "4"], "--num-attention-heads (6) must divide --hidden-size (64)"),
    (["tune", "--hidden-size", "96", "--ffn-hidden-size", "32", "--num-attention-heads", "6",
      "--tp", "4"], "--num-attention-heads (6) must be a multiple of --tp 4"),
    (["tune", "--model", "8b", "--tp", "2", "--seq-length", "4095"],
     "--seq-length (4095) must be a multiple of --tp 2"),
    (["tune", "--model", "8b", "--tp", "2", "--micro-batch-size", "-1"],
     "argument --micro-batch-size: expected an integer >= 1"),
    (["tune", "--model", "8b", "--tp", "2", "--reps", "0"], "argument --reps: expected"),
    (["tune", "--hidden-size", "64", "--tp", "2"], "missing: --ffn-hidden-size, "
                                                   "--num-attention-heads"),
])
def test_cli_refuses_values_that_describe_no_model(argv, says, capsys, tmp_path):
    if argv[0] == "tune":
        argv = argv + ["--wandb", "off", "--no-cache", "--yaml", str(tmp_path / "o.yaml")]
    err = _refused(argv, capsys)
    assert says in err, err
    assert not (tmp_path / "o.yaml").exists()


def test_cli_accepts_a_possible_model(capsys, tmp_path):
    yml = tmp_path / "o.yaml"
    argv = ["tune", "--hidden-size", "64", "--ffn-hidden-size", "128", "--num-attention-heads", "4",
            "--num-query-groups", "2", "--seq-length", "64", "--tp", "2", "--wandb", "off",
            "--no-cache", "--no-progress", "--yaml", str(yml)]
    assert main(argv) == 0
    assert yml.exists()


# -- files -----------------------------------------------------------------------------------

def _row(**over):
    row = {"op": "ag", "schedule": "ring", "m": 8192, "k": 8192, "n": 1280, "chunks": 8,
           "gemm_streams": 1, "mono_graph_ms": 0.3, "sched_graph_ms": 0.4, "sched_ms": 0.6,
           "host_us_sched": 800.0}
    row.update(over)
    return {k: v for k, v in row.items() if v is not ...}


@pytest.mark.parametrize("content,says", [
    ("{not json", "not valid JSON"),
    (json.dumps({"meta": {}}), "expected a list of rows or an object with 'rows'"),
    (json.dumps({"rows": [7]}), "row 0: expected an object, got int"),
    (json.dumps({"rows": [_row(), _row(m=...)]}), "row 1, field 'm': missing"),
    (json.dumps({"rows": [_row(k="big")]}), "row 0, field 'k': expected an integer >= 1, got 'big'"),
    (json.dumps({"rows": [_row(n=-2)]}), "row 0, field 'n': expected an integer >= 1, got -2"),
    (json.dumps({"rows": [_row(mono_graph_ms=0)]}), "field 'mono_graph_ms': expected a finite "
                                                   "time > 0, got 0"),
    (json.dumps({"rows": [_row(sched_graph_ms=-1.0)]}), "field 'sched_graph_ms': expected a "
                                                       "finite time > 0"),
    (json.dumps({"rows": [_row(op=3)]}), "field 'op': expected a string, got 3"),
])
def test_bad_calibration_file_names_file_row_and_field(tmp_path, capsys, content, says):
    path = tmp_path / "cal.json"
    path.write_text(content)
    err = _refused(["simulate", "--tp", "8", "--shapes", "70B_tp8_qkv", "--calibration", str(path)],
                   capsys)
    assert f"--calibration: calibration file {str(path)!r}" in err and says in err, err


def test_good_calibration_file_still_reads(tmp_path):
    from megatron_overlap.simulate import Calibration

    path = tmp_path / "cal.json"
    path.write_text(json.dumps({"rows": [_row(), _row(gemm_streams=2, m="ignored")]}))
    cal = Calibration.load(path)
    assert math.isclose(cal.mono[(8192, 8192, 1280, "NT")], 300)


@pytest.mark.parametrize("yaml_text,says", [
    ("qkv_fprop:\n  method: foo\n", "layer 'qkv_fprop', key 'method': got 'foo'"),
    ("proj_fprop:\n  num_splits: -2\n", "layer 'proj_fprop', key 'num_splits': got -2"),
    ("qkv_fpro:\n  method: bulk\n", "unknown layer 'qkv_fpro'"),
    ("fc1_fprop: [1, 2]\n", "layer 'fc1_fprop': expected a mapping"),
    ("fc1_fprop: {method: bulk\n", "not valid YAML"),
])
def test_bad_yaml_file_names_the_file_and_the_field(tmp_path, capsys, yaml_text, says):
    from megatron_overlap.config import ConfigError, OverlapConfig

    path = tmp_path / "ub.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ConfigError) as e:
        OverlapConfig.load(str(path))
    assert str(e.value).startswith(str(path)) and says in str(e.value), str(e.value)
    err = _refused(["simulate", "--tp", "8", "--shapes", "70B_tp8_qkv", "--cfg", str(path)], capsys)
    assert f"--cfg: {path}" in err and says in err, err
