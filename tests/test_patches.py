"""The Megatron-LM patch in patches/: --tp-comm-overlap-impl megatron_overlap.

Always: every patch parses (`git apply --stat`, plus our own hunk-length check),
its header names the Megatron-LM version, tag and commit it targets, and
patches/apply.py refuses what it cannot patch with a message naming that target.

With MEGATRON_LM_DIR pointing at a Megatron-LM checkout of the targeted version:
its megatron/ tree is copied to a temporary folder, patched there with
patches/apply.py, and the patched Megatron-LM is exercised in a subprocess:
the patched files compile, `parse_args` / `validate_args` accept and check the
new flags, and `_initialize_tp_communicators()` calls `megatron_overlap.install`
instead of Transformer Engine's `initialize_ub`.
"""

from __future__ import annotations

import json
import os
import py_compile
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATCH_DIR = ROOT / "patches"
APPLY = PATCH_DIR / "apply.py"
PATCHES = sorted(PATCH_DIR.glob("megatron-lm-*.patch"))
TOUCHED = {"megatron/training/arguments.py", "megatron/training/initialize.py"}
NOT_SET = "MEGATRON_LM_DIR not set: the patch was not applied to a Megatron-LM checkout in this run"

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not on PATH")


def header(patch: Path) -> str:
    text = patch.read_text()
    assert "\ndiff --git " in text, f"{patch.name} has no `diff --git` section"
    return text.split("\ndiff --git ", 1)[0]


def field(patch: Path, key: str) -> str:
    m = re.search(rf"^{key}:\s*(\S.*?)\s*$", header(patch), re.M)
    assert m, f"{patch.name}: header has no `{key}:` line"
    return m.group(1)


def test_there_is_a_patch():
    assert PATCHES, f"no megatron-lm-*.patch in {PATCH_DIR}"


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_parses(patch, tmp_path):
    # Outside any git work tree: inside one, git apply would skip paths outside the cwd.
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(tmp_path.parent))
    stat = subprocess.run(["git", "apply", "--numstat", str(patch)], capture_output=True,
                          text=True, cwd=tmp_path, env=env)
    assert stat.returncode == 0, f"git apply cannot parse {patch.name}:\n{stat.stderr}"
    files = {line.split("\t")[2] for line in stat.stdout.splitlines()}
    assert files == TOUCHED

    # Every hunk's line counts match its @@ header (what `git apply` checks, by hand).
    lines = patch.read_text().splitlines()
    i, hunks = 0, 0
    while i < len(lines):
        m = re.match(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@", lines[i])
        i += 1
        if not m:
            continue
        hunks += 1
        old, new = int(m.group(1) or 1), int(m.group(2) or 1)
        while old or new:
            assert i < len(lines), f"{patch.name}: hunk {hunks} is cut short"
            tag = lines[i][:1] or " "
            assert tag in " -+\\", f"{patch.name}:{i + 1}: not a hunk line: {lines[i]!r}"
            old -= tag in " -"
            new -= tag in " +"
            assert old >= 0 and new >= 0, f"{patch.name}: hunk {hunks} is longer than its header"
            i += 1
    assert hunks >= 3


@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: p.name)
def test_patch_header_names_its_target(patch):
    head = header(patch)
    assert not re.search(r"^(---|\+\+\+|@@|diff) ", head, re.M), "header would confuse patch(1)"
    version = field(patch, "Target-Version")
    tag = field(patch, "Target-Tag")
    assert re.fullmatch(r"megatron-core \d+\.\d+\.\d+\S*", version)
    assert version.split()[-1] in tag and tag in patch.name
    assert re.fullmatch(r"[0-9a-f]{40}", field(patch, "Target-Commit"))
    assert "megatron_overlap.install" in head and "--tp-comm-overlap-impl" in head


def run_apply(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(APPLY), *map(str, args)], capture_output=True,
                          text=True)


def test_apply_refuses_a_folder_that_is_not_megatron_lm(tmp_path):
    out = run_apply(tmp_path, "--check")
    assert out.returncode == 2 and "not a Megatron-LM checkout" in out.stderr


def test_apply_names_the_target_when_the_patch_does_not_apply(tmp_path):
    for rel in TOUCHED:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("# some other Megatron-LM\n")
    (tmp_path / "megatron/core").mkdir()
    (tmp_path / "megatron/core/package_info.py").write_text("MAJOR = 0\nMINOR = 99\nPATCH = 0\n")
    out = run_apply(tmp_path)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "no patch applies" in out.stderr and "0.99.0" in out.stderr
    for patch in PATCHES:
        assert field(patch, "Target-Tag") in out.stderr
        assert field(patch, "Target-Commit") in out.stderr
    assert (tmp_path / "megatron/training/arguments.py").read_text() == "# some other Megatron-LM\n"


# --- against a real Megatron-LM checkout ------------------------------------------------------

@pytest.fixture(scope="module")
def patched(tmp_path_factory) -> Path:
    """A patched copy of $MEGATRON_LM_DIR's megatron/ tree (the checkout is left alone)."""
    src = os.environ.get("MEGATRON_LM_DIR")
    if not src:
        pytest.skip(NOT_SET)
    src = Path(src)
    assert (src / "megatron/training/arguments.py").is_file(), \
        f"MEGATRON_LM_DIR={src} is not a Megatron-LM checkout"
    dst = tmp_path_factory.mktemp("megatron-lm")
    shutil.copytree(src / "megatron", dst / "megatron",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    check = run_apply(dst, "--check")
    assert check.returncode == 0, f"the patch does not apply to {src}:\n{check.stderr}"
    done = run_apply(dst)
    assert done.returncode == 0 and "applied to" in done.stdout, done.stdout + done.stderr
    again = run_apply(dst)
    assert again.returncode == 0 and "already applied" in again.stdout, again.stdout
    return dst


def test_patched_files_compile(patched):
    for rel in TOUCHED:
        py_compile.compile(str(patched / rel), doraise=True,
                           cfile=str(patched / (rel + ".compiled")))


# Run in a fresh interpreter against the patched tree. Modules Megatron-LM's training
# package imports but argument parsing never uses are stubbed when not installed (the
# tokenizers' `six` / `regex`; the triton kernels of batch-invariant mode), and so is the
# GPU query of validate_args: this runs on CPU-only machines.
PROBE = textwrap.dedent(r"""
    import importlib.util, inspect, json, os, sys, types
    stubbed = []
    for name in ("six", "regex"):
        if importlib.util.find_spec(name) is None:
            sys.modules[name] = types.ModuleType(name); stubbed.append(name)
    if importlib.util.find_spec("triton") is None:
        kernels = types.ModuleType("megatron.core.transformer.custom_layers.batch_invariant_kernels")
        kernels.enable_batch_invariant_mode = lambda *a, **k: None
        sys.modules[kernels.__name__] = kernels; stubbed.append("triton kernels")

    from megatron.training import arguments, global_vars, initialize
    import megatron_overlap
    arguments.get_device_arch_version = lambda: 9
    os.environ.update(WORLD_SIZE="2", RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1")
    BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "128", "--max-position-embeddings", "128", "--micro-batch-size", "1",
            "--global-batch-size", "2", "--lr", "1e-4", "--train-iters", "1",
            "--tensor-model-parallel-size", "2"]
    OURS = ["--tp-comm-overlap", "--tp-comm-overlap-impl", "megatron_overlap",
            "--tp-comm-overlap-cfg", "x.yaml", "--sequence-parallel"]

    def parse(*extra):
        sys.argv = ["pretrain_gpt.py", *BASE, *extra]
        return arguments.parse_args()

    def validate(args):
        try:
            arguments.validate_args(args)
            return None
        except AssertionError as e:
            return str(e)

    def init(args):
        calls = []
        real, megatron_overlap.install = megatron_overlap.install, lambda **kw: calls.append(kw)
        global_vars._GLOBAL_ARGS = None
        global_vars.set_args(args)
        try:
            initialize._initialize_tp_communicators()
            error = None
        except RuntimeError as e:
            error = str(e)
        finally:
            megatron_overlap.install = real
        return {"calls": calls, "error": error, "te_imported": "transformer_engine" in sys.modules}

    out = {"stubbed": stubbed, "arguments_file": arguments.__file__}
    a = parse(*OURS, "--transformer-impl", "local")
    out["ours"] = {k: getattr(a, k) for k in ("tp_comm_overlap", "tp_comm_overlap_impl",
                   "tp_comm_overlap_cfg", "tp_comm_overlap_backend", "transformer_impl",
                   "sequence_parallel")}
    out["ours_valid"] = validate(a)
    out["ours_init"] = init(a)
    b = parse(*OURS, "--transformer-impl", "local", "--tp-comm-overlap-backend", "torch_p2p")
    out["backend"] = b.tp_comm_overlap_backend
    b.tp_comm_overlap_cfg = None
    out["no_cfg_init"] = init(b)
    out["with_te_layers"] = validate(parse(*OURS, "--transformer-impl", "transformer_engine"))
    out["no_sp"] = validate(parse(*[x for x in OURS if x != "--sequence-parallel"],
                                  "--transformer-impl", "local"))
    d = parse()
    out["default"] = [d.tp_comm_overlap, d.tp_comm_overlap_impl, d.tp_comm_overlap_backend,
                      d.tp_comm_overlap_cfg]
    d = parse("--tp-comm-overlap", "--sequence-parallel")
    out["te_valid"] = validate(d)
    out["te_init"] = init(d)
    try:
        parse("--tp-comm-overlap-backend", "bogus")
        out["bogus_backend"] = "accepted"
    except SystemExit as e:
        out["bogus_backend"] = e.code
    out["install_signature"] = str(inspect.signature(megatron_overlap.install))
    inspect.signature(megatron_overlap.install).bind(ub_cfgs="x.yaml", backend="torch_p2p")
    print("PROBE-RESULT " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def probe(patched) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(patched), str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         cwd=patched, env=env, timeout=600)
    missing = re.search(r"ModuleNotFoundError: No module named '([^']+)'", run.stderr)
    if run.returncode != 0 and missing and not missing.group(1).startswith("megatron"):
        pytest.skip(f"importing the patched megatron.training needs `{missing.group(1)}`, not "
                    "installed here: only test_patched_files_compile checked the patch")
    result = [line for line in run.stdout.splitlines() if line.startswith("PROBE-RESULT ")]
    assert run.returncode == 0 and result, f"probe failed:\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    return json.loads(result[-1][len("PROBE-RESULT "):])


def test_probe_ran_the_patched_tree(probe, patched):
    assert Path(probe["arguments_file"]).resolve() == (patched / "megatron/training/arguments.py").resolve()


def test_flags_parse(probe):
    assert probe["ours"] == {"tp_comm_overlap": True, "tp_comm_overlap_impl": "megatron_overlap",
                             "tp_comm_overlap_cfg": "x.yaml", "tp_comm_overlap_backend": "auto",
                             "transformer_impl": "local", "sequence_parallel": True}
    assert probe["backend"] == "torch_p2p"
    assert probe["bogus_backend"] == 2  # argparse's usage error


def test_defaults_keep_todays_behaviour(probe):
    assert probe["default"] == [False, "te", "auto", None]
    assert probe["te_valid"] is None
    # te: the unchanged path, which needs Transformer Engine (not installed on CPU test
    # machines) and never calls megatron_overlap.
    assert probe["te_init"]["calls"] == []
    if probe["te_init"]["error"] is not None:
        assert "transformer_engine" in probe["te_init"]["error"]


def test_validate_args(probe):
    assert probe["ours_valid"] is None
    assert "--transformer-impl local" in probe["with_te_layers"]
    assert "sequence parallelism" in probe["no_sp"]  # Megatron-LM's own requirement, kept


def test_initialize_calls_install_instead_of_initialize_ub(probe):
    assert probe["ours_init"] == {"calls": [{"ub_cfgs": "x.yaml", "backend": "auto"}],
                                  "error": None, "te_imported": False}
    assert probe["no_cfg_init"]["calls"] == [{"ub_cfgs": None, "backend": "torch_p2p"}]
    assert probe["no_cfg_init"]["error"] is None
