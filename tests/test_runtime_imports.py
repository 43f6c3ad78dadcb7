"""The runtime imports with torch and megatron-core alone: wandb, rich and matplotlib
are the tools' extras, torchao FP8's (pyproject.toml), and a feature that needs a
missing one says which extra installs it. Each check runs in a fresh interpreter in which the extras
cannot be imported."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXTRAS = ("wandb", "rich", "matplotlib", "torchao")

# Makes every module of EXTRAS unimportable, as if never installed.
BLOCKER = f"""
import sys
class _Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {EXTRAS!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked)", name=name)
        return None
sys.meta_path.insert(0, _Blocked())
"""


def _run(code: str, tmp_path=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", BLOCKER + code], capture_output=True, text=True,
                          env=env, cwd=tmp_path or ROOT, timeout=240)


def _loaded(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


REPORT = f"""
import json
blocked = {{m for m in sys.modules if m.partition(".")[0] in {EXTRAS!r}}}
print(json.dumps({{"blocked": sorted(blocked),
                  "integration": "megatron_overlap.megatron" in sys.modules,
                  "megatron": "megatron.core" in sys.modules}}))
"""


def test_blocker_blocks():
    proc = _run("import wandb")
    assert proc.returncode != 0 and "No module named 'wandb' (blocked)" in proc.stderr


def test_runtime_subpackages_import_without_extras_or_integration():
    got = _loaded(_run("import megatron_overlap.overlap, megatron_overlap.comm, "
                       "megatron_overlap.config\n" + REPORT))
    assert got == {"blocked": [], "integration": False, "megatron": False}


def test_install_and_the_settings_table_work_without_extras():
    code = """
import megatron_overlap
from megatron_overlap.config import OverlapConfig
megatron_overlap.install()
text = OverlapConfig.load(None).table("symm", tp_size=4)
assert "qkv_fprop" in text and "no effect" in text, text
megatron_overlap.uninstall()
"""
    got = _loaded(_run(code + REPORT))
    assert got["blocked"] == [] and got["integration"]


def test_tools_import_without_extras():
    code = ("import megatron_overlap.telemetry, megatron_overlap.simulate, megatron_overlap.tune, "
            "megatron_overlap.ab, megatron_overlap.cli\n")
    assert _loaded(_run(code + REPORT))["blocked"] == []


@pytest.mark.parametrize("module,extra", [("wandb", "wandb"), ("rich.progress", "tools"),
                                          ("matplotlib", "ab"),
                                          ("torchao.float8.float8_utils", "fp8")])
def test_require_names_the_extra(module, extra):
    code = f"""
from megatron_overlap.extras import MissingExtra, require
try:
    require({module!r}, "the feature")
except MissingExtra as e:
    print(e)
else:
    raise SystemExit("no error")
"""
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    top = module.partition(".")[0]
    assert proc.stdout.strip() == (f"the feature needs {top}, which is not installed: "
                                   f"pip install 'megatron-overlap[{extra}]'")


def test_fp8_without_torchao_names_the_extra():
    """The overlap layer imports without torchao; FP8 asks for it when it first runs."""
    code = """
import torch
from megatron_overlap.extras import MissingExtra
from megatron_overlap.overlap import fp8
try:
    fp8.scale_for(fp8.amax(torch.ones(2)), torch.float8_e4m3fn)  # every FP8 pass scales
except MissingExtra as e:
    print(e)
"""
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == ("FP8 in the overlapped linears needs torchao, which is not "
                                   "installed: pip install 'megatron-overlap[fp8]'")


def test_tools_missing_an_extra_name_it(tmp_path):
    """The tuner's wandb log, its progress bar, offline-run reading and the A/B report:
    each names its extra; the tuner without them (--wandb off --no-progress) still runs."""
    code = """
import json
from megatron_overlap.cli import main
from megatron_overlap.extras import MissingExtra
out = {}
args = ["tune", "--model", "8b", "--tp", "2", "--measure", "model", "--yaml", "t.yaml"]
out["wandb"] = main(args + ["--no-progress"])
out["progress"] = main(args + ["--wandb", "off"])
out["plain"] = main(args + ["--wandb", "off", "--no-progress"])
from megatron_overlap.ab import write_report
from megatron_overlap.telemetry.offline import iter_records
for name, call in (("offline", lambda: list(iter_records("x.wandb"))),
                   ("report", lambda: write_report({"a": []}, ".", title="t", baseline="a"))):
    try:
        call()
        out[name] = "no error"
    except MissingExtra as e:
        out[name] = str(e)
print(json.dumps(out))
"""
    proc = _run(code, tmp_path)
    got = _loaded(proc)
    assert got["wandb"] == 2 and got["progress"] == 2 and got["plain"] == 0
    err = proc.stderr
    assert "needs wandb, which is not installed: pip install 'megatron-overlap[wandb]'" in err
    assert "needs rich, which is not installed: pip install 'megatron-overlap[tools]'" in err
    assert got["offline"].endswith("pip install 'megatron-overlap[wandb]'")
    assert got["report"].endswith("pip install 'megatron-overlap[ab]'")
    assert (tmp_path / "t.yaml").exists()


# What each package of the runtime may import (its __init__ docstring says the same):
# each layer only the ones above it; only `layers` and `megatron` touch megatron-core.
LAYERS = {
    "config": (set(), False, False),
    "comm": ({"config"}, True, False),
    "overlap": ({"config", "comm"}, True, False),
    "layers": ({"config", "comm", "overlap"}, True, True),
    "megatron": ({"config", "comm", "overlap", "layers"}, True, True),
    # the entry point: the backend names at import; torch, megatron and the integration
    # only once the script's tree is first on sys.path (inside its hooks)
    "megatron_lm": ({"config"}, False, False),
}


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_each_runtime_package_imports_only_the_layers_above_it(package):
    code = f"""
import json
import megatron_overlap.{package}
ours = {{m.split(".")[1] for m in sys.modules
        if m.startswith("megatron_overlap.") and m.split(".")[1] != {package!r}}}
print(json.dumps({{"ours": sorted(ours), "torch": "torch" in sys.modules,
                  "megatron": "megatron.core" in sys.modules}}))
"""
    got = _loaded(_run(code))
    allowed, torch_ok, megatron_ok = LAYERS[package]
    assert set(got["ours"]) <= allowed, got["ours"]
    assert got["torch"] <= torch_ok and got["megatron"] <= megatron_ok, got
