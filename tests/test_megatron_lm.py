"""The patch-free Megatron-LM entry point, `python -m megatron_overlap.megatron_lm`.

Always: the hooks on a small stand-in for Megatron-LM's two modules (flags, validation,
`_initialize_tp_communicators` -> install(), TE's path untouched for `te`), the clear
error for a Megatron-LM they cannot serve (a function missing, another signature, not
called where expected), the entry point's own usage, and that importing the package
imports no megatron.

With MEGATRON_LM_DIR pointing at a Megatron-LM checkout (outside this project), that
tree runs on CPU through the entry point (tests/helpers/megatron_lm_cpu.py): its
pretrain_gpt.py --help, its parser and validate_args with our flags, its
_initialize_tp_communicators, and on 2 gloo ranks its initialize_megatron and
pretrain_gpt's model_provider with the local spec: the four TP linears of every layer
are ours with --tp-comm-overlap and Megatron's without, and both give the same loss.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from helpers.dist import _free_port
from megatron_overlap.megatron_lm import hooks

ROOT = Path(__file__).resolve().parents[1]
HELPERS = ROOT / "tests" / "helpers"
NOT_SET = ("MEGATRON_LM_DIR not set: needs an external Megatron-LM checkout "
           "(e.g. git archive core_v0.16.1) to run its start-up on CPU")

# --- a stand-in for megatron.training.{arguments,initialize}, shaped like core_v0.16 -----------

ARGUMENTS = """
import argparse
def add_megatron_arguments(parser):
    parser.add_argument("--tp-comm-overlap", action="store_true")
    parser.add_argument("--tp-comm-overlap-cfg", default=None)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--transformer-impl", default="transformer_engine")
    parser.add_argument("--fp8-format", dest="fp8", default=None)
    parser.add_argument("--fp8-recipe", default="delayed")
    parser.add_argument("--no-create-attention-mask-in-dataloader", action="store_false",
                        dest="create_attention_mask_in_dataloader")
    parser.add_argument("--reset-attention-mask", action="store_true")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--sft", action="store_true")
    parser.add_argument("--dataloader-inter-document-masking", action="store_true")
    return parser
def parse_args(extra_args_provider=None, ignore_unknown_args=False):
    parser = add_megatron_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    return parser.parse_args(ARGV)
def validate_args(args, defaults={}):
    if args.tp_comm_overlap:
        assert args.sequence_parallel, "needs sequence parallelism"
"""
INITIALIZE = """
from megatron.training.arguments import parse_args, validate_args
import megatron.training as training
TE_CALLS = []
def initialize_megatron(extra_args_provider=None, args_defaults={}):
    args = parse_args(extra_args_provider)
    validate_args(args, args_defaults)
    training.ARGS = args
    if args.tp_comm_overlap:
        _initialize_tp_communicators()
def _initialize_tp_communicators():
    TE_CALLS.append("initialize_ub")
"""


def _module(monkeypatch, name: str, source: str | None, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    monkeypatch.setitem(sys.modules, name, mod)
    if source is not None:
        exec(textwrap.dedent(source), mod.__dict__)
    return mod


@pytest.fixture
def fake_lm(monkeypatch):
    """megatron.training with the two modules above (megatron.core is the installed one);
    `make(arguments=..., initialize=...)` swaps in other sources; None drops a module."""
    pytest.importorskip("megatron.core")

    def make(arguments: str | None = ARGUMENTS, initialize: str | None = INITIALIZE, argv=()):
        training = _module(monkeypatch, "megatron.training", None, ARGS=None)
        training.get_args = lambda: training.ARGS
        mods = {"training": training}
        if arguments is not None:
            mods["arguments"] = _module(monkeypatch, "megatron.training.arguments", arguments,
                                        ARGV=list(argv))
        else:
            monkeypatch.setitem(sys.modules, "megatron.training.arguments", None)
        if initialize is not None:
            mods["initialize"] = _module(monkeypatch, "megatron.training.initialize", initialize)
        else:
            monkeypatch.setitem(sys.modules, "megatron.training.initialize", None)
        return types.SimpleNamespace(**mods)

    yield make
    hooks.uninstall_hooks()


@pytest.fixture
def installs(monkeypatch):
    import megatron_overlap

    calls: list[dict] = []
    monkeypatch.setattr(megatron_overlap, "install", lambda **kw: calls.append(kw), raising=False)
    return calls


OURS = ["--tp-comm-overlap", "--tp-comm-overlap-impl", "megatron_overlap", "--sequence-parallel",
        "--transformer-impl", "local", "--tp-comm-overlap-cfg", "ub.yaml",
        "--tp-comm-overlap-backend", "symm"]


def test_hooks_turn_tp_comm_init_into_install(fake_lm, installs):
    lm = fake_lm(argv=OURS)
    hooks.install_hooks()
    # every binding of the three functions is wrapped, also initialize's own imports
    for mod, name in [(lm.arguments, "add_megatron_arguments"), (lm.arguments, "validate_args"),
                      (lm.initialize, "validate_args"), (lm.initialize, "_initialize_tp_communicators")]:
        assert hasattr(getattr(mod, name), "__wrapped__"), f"{mod.__name__}.{name} not hooked"
    lm.initialize.initialize_megatron()
    assert installs == [{"ub_cfgs": "ub.yaml", "backend": "symm", "attention": "torch",
                        "fp8_scaling": "tensorwise", "fp8_fast_accum": "fprop", "fp8_fused_activation": True}]
    assert lm.initialize.TE_CALLS == []
    args = lm.training.ARGS
    assert (args.tp_comm_overlap_impl, args.tp_comm_overlap_backend) == ("megatron_overlap", "symm")


def test_te_impl_keeps_megatron_lm_s_own_path(fake_lm, installs):
    lm = fake_lm(argv=["--tp-comm-overlap", "--sequence-parallel"])
    hooks.install_hooks()
    lm.initialize.initialize_megatron()
    assert lm.training.ARGS.tp_comm_overlap_impl == "te"
    assert lm.initialize.TE_CALLS == ["initialize_ub"] and installs == []


def test_impl_without_tp_comm_overlap_installs_with_everything_off(fake_lm, installs):
    lm = fake_lm(argv=["--tp-comm-overlap-impl", "megatron_overlap", "--sequence-parallel",
                       "--tp-comm-overlap-backend", "torch_p2p"])
    hooks.install_hooks()
    lm.initialize.initialize_megatron()
    assert installs == [{"ub_cfgs": None, "backend": "torch_p2p", "attention": "torch",
                        "fp8_scaling": "tensorwise", "fp8_fast_accum": "fprop", "fp8_fused_activation": True}]  # at validation: SP norms
    assert lm.initialize.TE_CALLS == []


@pytest.mark.parametrize("extra,attention,masks", [
    ([], "torch", False),  # plain causal masks: the causal mask type says the same, not made
    (["--reset-attention-mask"], "torch", True),  # document masks: made and used as given
    (["--megatron-overlap-attention", "megatron"], "megatron", True),  # Megatron's attention
    (["--attention-backend", "unfused"], "torch", True),  # Megatron's unfused attention by name
    (["--no-create-attention-mask-in-dataloader"], "torch", False),
])
def test_attention_choice_and_the_dataloaders_causal_masks(fake_lm, installs, extra, attention, masks):
    lm = fake_lm(argv=OURS + extra)
    hooks.install_hooks()
    lm.initialize.initialize_megatron()
    assert installs == [{"ub_cfgs": "ub.yaml", "backend": "symm", "attention": attention,
                        "fp8_scaling": "tensorwise", "fp8_fast_accum": "fprop", "fp8_fused_activation": True}]
    assert lm.training.ARGS.create_attention_mask_in_dataloader is masks


@pytest.mark.parametrize("packed", ["--sft", "--dataloader-inter-document-masking"])
def test_packed_sequences_with_megatron_s_attention_stop_at_validation(fake_lm, installs, packed,
                                                                        monkeypatch):
    """Megatron's DotProductAttention refuses packed sequences at the first step: with it
    kept, a packed run stops at start-up; with torch's attention (the default) it runs.
    (--sft packs where the tree's SFT dataset does: `hooks._sft_packs`, on real trees in
    test_validation_in_that_tree.)"""
    monkeypatch.setattr(hooks, "_sft_packs", lambda: True)
    for keep, why in ((["--megatron-overlap-attention", "megatron"], "--megatron-overlap-attention megatron"),
                      (["--attention-backend", "unfused"], "--attention-backend unfused")):
        lm = fake_lm(argv=OURS + [packed] + keep)
        hooks.install_hooks()
        with pytest.raises(ValueError, match=f"{packed} packs documents") as e:
            lm.initialize.initialize_megatron()
        assert f"kept by {why}" in str(e.value) and "--megatron-overlap-attention torch" in str(e.value)
        hooks.uninstall_hooks()
    assert installs == []
    # a model setting torch's kernels lack hands every layer back to Megatron's attention
    args = argparse.Namespace(tp_comm_overlap_impl="megatron_overlap", tp_comm_overlap=True,
                              transformer_impl="local", qk_clip=True, **{packed[2:].replace("-", "_"): True})
    with pytest.raises(ValueError, match="kept by the model's qk_clip needs the attention logits"):
        hooks.check_args(args)
    lm = fake_lm(argv=OURS + [packed])
    hooks.install_hooks()
    lm.initialize.initialize_megatron()
    assert installs == [{"ub_cfgs": "ub.yaml", "backend": "symm", "attention": "torch",
                         "fp8_scaling": "tensorwise", "fp8_fast_accum": "fprop", "fp8_fused_activation": True}]


def test_validation(fake_lm, installs):
    lm = fake_lm(argv=["transformer_engine" if a == "local" else a for a in OURS])
    hooks.install_hooks()
    with pytest.raises(ValueError, match="use --transformer-impl local"):
        lm.initialize.initialize_megatron()
    lm.arguments.ARGV[:] = [a for a in OURS if a != "--sequence-parallel"]
    with pytest.raises(AssertionError, match="sequence parallelism"):  # Megatron-LM's own rule
        lm.initialize.initialize_megatron()
    assert installs == [] and lm.initialize.TE_CALLS == []


def test_rowwise_scaling_flag_reaches_install_and_needs_fp8_tensorwise(fake_lm, installs):
    rowwise = ["--megatron-overlap-fp8-scaling", "rowwise"]
    lm = fake_lm(argv=OURS + rowwise + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"])
    hooks.install_hooks()
    lm.initialize.initialize_megatron()
    assert installs == [{"ub_cfgs": "ub.yaml", "backend": "symm", "attention": "torch",
                         "fp8_scaling": "rowwise", "fp8_fast_accum": "fprop", "fp8_fused_activation": True}]
    for extra, said in (([], "--fp8-format None"), (["--fp8-format", "hybrid"], "--fp8-recipe delayed")):
        lm.arguments.ARGV[:] = OURS + rowwise + extra
        with pytest.raises(ValueError, match="needs --fp8-format and --fp8-recipe tensorwise") as e:
            lm.initialize.initialize_megatron()
        assert said in str(e.value)
    lm.arguments.ARGV[:] = rowwise + ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise",
                                      "--sequence-parallel"]  # Transformer Engine's path
    with pytest.raises(ValueError, match="needs --tp-comm-overlap-impl megatron_overlap"):
        lm.initialize.initialize_megatron()
    assert len(installs) == 1 and lm.initialize.TE_CALLS == []


def test_fast_accumulation_flag_reaches_install_and_needs_our_impl(fake_lm, installs):
    lm = fake_lm(argv=OURS + ["--megatron-overlap-fp8-fast-accum", "all", "--fp8-format", "hybrid",
                              "--fp8-recipe", "tensorwise"])
    hooks.install_hooks()
    lm.initialize.initialize_megatron()
    assert installs == [{"ub_cfgs": "ub.yaml", "backend": "symm", "attention": "torch",
                         "fp8_scaling": "tensorwise", "fp8_fast_accum": "all", "fp8_fused_activation": True}]
    lm.arguments.ARGV[:] = OURS + ["--megatron-overlap-fp8-fast-accum", "none"]  # no FP8 at all
    with pytest.raises(ValueError, match="--megatron-overlap-fp8-fast-accum none chooses the FP8 "
                                         "GEMMs that accumulate fast: it needs --fp8-format"):
        lm.initialize.initialize_megatron()
    lm.arguments.ARGV[:] = ["--megatron-overlap-fp8-fast-accum", "none", "--fp8-format", "hybrid",
                            "--sequence-parallel"]  # Transformer Engine's path: not read there
    with pytest.raises(ValueError, match="--megatron-overlap-fp8-fast-accum none sets the FP8 "
                                         "accumulation .* needs --tp-comm-overlap-impl megatron_overlap"):
        lm.initialize.initialize_megatron()
    assert len(installs) == 1 and lm.initialize.TE_CALLS == []


def test_unfused_activation_flag_reaches_install(fake_lm, installs):
    lm = fake_lm(argv=OURS + ["--megatron-overlap-fp8-unfused-activation", "--fp8-format",
                              "hybrid", "--fp8-recipe", "tensorwise"])
    hooks.install_hooks()
    lm.initialize.initialize_megatron()
    assert installs == [{"ub_cfgs": "ub.yaml", "backend": "symm", "attention": "torch",
                         "fp8_scaling": "tensorwise", "fp8_fast_accum": "fprop",
                         "fp8_fused_activation": False}]


def test_fp8_without_tp_comm_overlap_stops_at_validation(fake_lm, installs):
    """Without --tp-comm-overlap Megatron's local linears would be built: bf16 in silence."""
    lm = fake_lm(argv=["--tp-comm-overlap-impl", "megatron_overlap", "--sequence-parallel",
                       "--fp8-format", "hybrid"])
    hooks.install_hooks()
    with pytest.raises(ValueError, match="--fp8-format hybrid with --tp-comm-overlap-impl "
                                         "megatron_overlap needs --tp-comm-overlap"):
        lm.initialize.initialize_megatron()
    assert installs == [] and lm.initialize.TE_CALLS == []
    lm.arguments.ARGV[:] = ["--fp8-format", "hybrid", "--sequence-parallel"]  # TE's path: theirs
    lm.initialize.initialize_megatron()
    assert installs == []


def test_our_flags_parse_and_refuse_unknown_values():
    parser = hooks.add_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py"))
    ns = parser.parse_args([])
    assert (ns.tp_comm_overlap_impl, ns.tp_comm_overlap_backend) == ("te", "auto")
    with pytest.raises(SystemExit):
        parser.parse_args(["--tp-comm-overlap-backend", "bogus"])
    text = parser.format_help()
    assert "--tp-comm-overlap-impl {te,megatron_overlap}" in text
    assert "--tp-comm-overlap-backend {auto,torch_p2p,symm,nvshmem}" in text
    assert "--megatron-overlap-attention {torch,megatron}" in text
    assert "--megatron-overlap-fp8-scaling {tensorwise,rowwise}" in text
    assert ns.megatron_overlap_fp8_scaling == "tensorwise"
    assert "--megatron-overlap-fp8-fast-accum {fprop,none,all}" in text
    assert ns.megatron_overlap_fp8_fast_accum == "fprop"
    with pytest.raises(SystemExit):
        parser.parse_args(["--megatron-overlap-fp8-fast-accum", "dgrad"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--megatron-overlap-fp8-scaling", "blockwise"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--megatron-overlap-attention", "flash"])
    # a tree patched with patches/ already has them: no argparse conflict
    hooks.add_arguments(parser)


def test_arguments_lost_by_yaml_cfg_are_an_error_not_te(fake_lm, installs):
    lm = fake_lm(argv=OURS)
    hooks.install_hooks()
    lm.training.ARGS = argparse.Namespace(tp_comm_overlap=True)  # what --yaml-cfg leaves
    with pytest.raises(hooks.UnsupportedMegatronLM, match="no tp_comm_overlap_impl"):
        lm.initialize._initialize_tp_communicators()
    assert lm.initialize.TE_CALLS == [] and installs == []


UNSERVABLE = {
    "tp-init missing": (ARGUMENTS, INITIALIZE.replace("def _initialize_tp_communicators",
                                                      "def _renamed"),
                        "megatron.training.initialize._initialize_tp_communicators is missing"),
    "validate signature": (ARGUMENTS.replace("def validate_args(args,", "def validate_args(cfg,")
                           .replace("args.tp", "cfg.tp").replace("args.seq", "cfg.seq"), INITIALIZE,
                           "megatron.training.arguments.validate_args takes (cfg), expected (args)"),
    "parser not extended there": (ARGUMENTS.replace("parser = add_megatron_arguments(",
                                                    "parser = ("), INITIALIZE,
                                  "add_megatron_arguments is not called from "
                                  "megatron.training.arguments.parse_args"),
    "tp-init not called": (ARGUMENTS, INITIALIZE.replace("        _initialize_tp_communicators()",
                                                         "        pass"),
                           "_initialize_tp_communicators is not called from "
                           "megatron.training.initialize.initialize_megatron"),
    "no initialize module": (ARGUMENTS, None, "module megatron.training.initialize is missing"),
}


@pytest.mark.parametrize("case", UNSERVABLE, ids=list(UNSERVABLE))
def test_unservable_megatron_lm_is_a_clear_error_at_start_up(fake_lm, case):
    arguments, initialize, missing = UNSERVABLE[case]
    lm = fake_lm(arguments=arguments, initialize=initialize)
    before = dict(vars(lm.arguments))
    with pytest.raises(hooks.UnsupportedMegatronLM) as e:
        hooks.install_hooks()
    text = str(e.value)
    assert f"megatron-core {hooks.megatron_core_version()}" in text and missing in text
    assert "Nothing was changed" in text
    assert not hooks.installed() and dict(vars(lm.arguments)) == before


def test_entry_point_usage():
    def run(*argv):
        return subprocess.run([sys.executable, "-m", "megatron_overlap.megatron_lm", *argv],
                              capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert run().returncode == 2 and "usage:" in run().stdout
    out = run("--help")
    assert out.returncode == 0 and "--tp-comm-overlap-backend" in out.stdout
    out = run("no_such_script.py")
    assert out.returncode != 0 and "no such script: no_such_script.py" in out.stderr


def _stand_in_tree(root: Path, initialize: str = INITIALIZE) -> Path:
    """A folder shaped like Megatron-LM (megatron/training/..., a script) whose
    megatron.core is the installed one (megatron/ is a namespace package)."""
    training = root / "megatron" / "training"
    training.mkdir(parents=True)
    (training / "__init__.py").write_text("ARGS = None\ndef get_args():\n    return ARGS\n")
    (training / "arguments.py").write_text("ARGV = None\n" + textwrap.dedent(ARGUMENTS))
    (training / "initialize.py").write_text(textwrap.dedent(initialize))
    (root / "train.py").write_text(textwrap.dedent("""
        import json, sys
        import megatron_overlap
        from megatron.training import initialize
        calls = []
        megatron_overlap.install = lambda **kw: calls.append(kw)
        initialize.initialize_megatron()
        print("RESULT " + json.dumps({"calls": calls, "te": initialize.TE_CALLS,
                                      "argv0": sys.argv[0], "path0": sys.path[0]}))
    """))
    return root / "train.py"


def test_entry_point_runs_the_script_with_the_hooks(tmp_path):
    script = _stand_in_tree(tmp_path)
    run = subprocess.run([sys.executable, "-m", "megatron_overlap.megatron_lm", str(script), *OURS],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    result = json.loads(run.stdout.split("RESULT ", 1)[1])
    assert result == {"calls": [{"ub_cfgs": "ub.yaml", "backend": "symm", "attention": "torch",
                        "fp8_scaling": "tensorwise", "fp8_fast_accum": "fprop", "fp8_fused_activation": True}], "te": [],
                      "argv0": str(script), "path0": str(tmp_path)}
    run = subprocess.run([sys.executable, "-m", "megatron_overlap.megatron_lm", str(script),
                          "--help"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 0 and "--tp-comm-overlap-impl {te,megatron_overlap}" in run.stdout


def test_entry_point_refuses_an_unservable_tree_before_running_it(tmp_path):
    script = _stand_in_tree(tmp_path, UNSERVABLE["tp-init missing"][1])
    run = subprocess.run([sys.executable, "-m", "megatron_overlap.megatron_lm", str(script), *OURS],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert run.returncode == 1 and "RESULT" not in run.stdout
    last = run.stderr.splitlines()[-1]
    assert last.startswith("error: megatron_overlap.megatron_lm cannot serve Megatron-LM with "
                           f"megatron-core {hooks.megatron_core_version()} (at ")
    assert "_initialize_tp_communicators is missing" in last and "Traceback" not in run.stderr


def test_importing_the_package_imports_no_megatron():
    code = ("import sys, megatron_overlap, megatron_overlap.megatron_lm; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'megatron'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


# --- a real Megatron-LM tree ------------------------------------------------------------------

@pytest.fixture(scope="module")
def tree() -> Path:
    src = os.environ.get("MEGATRON_LM_DIR")
    if not src:
        pytest.skip(NOT_SET)
    src = Path(src).resolve()
    assert (src / "pretrain_gpt.py").is_file() and (src / "megatron/training/arguments.py").is_file(), \
        f"MEGATRON_LM_DIR={src} is not a Megatron-LM checkout (pretrain_gpt.py, megatron/training)"
    return src


def _env(tree: Path, **extra: str) -> dict:
    env = dict(os.environ, NO_VCS_VERSION="1", CUDA_DEVICE_MAX_CONNECTIONS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(tree), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _through_entry_point(tree: Path, *argv: str, env: dict | None = None,
                         popen: bool = False):
    cmd = [sys.executable, str(HELPERS / "megatron_lm_cpu.py"), *argv]
    kw = dict(cwd=tree, env=env or _env(tree), text=True, stdout=subprocess.PIPE,
              stderr=subprocess.STDOUT)
    return subprocess.Popen(cmd, **kw) if popen else subprocess.run(cmd, timeout=600, **kw)


def _result(output: str, what: str) -> dict:
    lines = [ln for ln in output.splitlines() if ln.startswith("PROBE-RESULT ")]
    assert lines, f"{what} printed no result:\n{output[-8000:]}"
    return json.loads(lines[-1][len("PROBE-RESULT "):])


@pytest.fixture(scope="module")
def probe(tree) -> dict:
    out = _through_entry_point(tree, str(HELPERS / "megatron_lm_probe.py"), "args")
    assert out.returncode == 0, out.stdout[-8000:]
    return _result(out.stdout, "the args probe")


def test_probe_ran_that_tree_with_every_target_hooked(probe, tree):
    assert Path(probe["arguments_file"]).resolve() == tree / "megatron/training/arguments.py"
    assert probe["hooked"] and all(probe["hooked"].values()), probe["hooked"]


def test_help_lists_our_flags(probe, tree):
    out = _through_entry_point(tree, str(tree / "pretrain_gpt.py"), "--help")
    if probe["help_without_hooks"]["ok"]:
        assert out.returncode == 0, out.stdout[-4000:]
        for line in probe["help"]["lists"] + ["--tp-comm-overlap-impl {te,megatron_overlap}"]:
            assert line in out.stdout
        assert probe["help"]["ok"] and len(probe["help"]["lists"]) == 3
    else:
        # Megatron-LM's own --help is broken in this tree (core_v0.18+: a bare '%' in its
        # help strings); ours fails the same way, no worse, and our group formats.
        assert probe["help"] == probe["help_without_hooks"]
        assert probe["help"]["error"] in out.stdout and out.returncode != 0
        assert "--tp-comm-overlap-impl {te,megatron_overlap}" in probe["our_help"]
        assert "--tp-comm-overlap-backend {auto,torch_p2p,symm,nvshmem}" in probe["our_help"]


def test_flags_parse_in_that_tree(probe):
    assert probe["ours"] == {"tp_comm_overlap": True, "tp_comm_overlap_impl": "megatron_overlap",
                             "tp_comm_overlap_cfg": "x.yaml", "tp_comm_overlap_backend": "auto",
                             "transformer_impl": "local", "sequence_parallel": True}
    assert probe["default"] == [False, "te", "auto", None]
    assert probe["bogus_backend"] == 2  # argparse's usage error


def test_validation_in_that_tree(probe):
    assert probe["ours_valid"] is None and probe["te_valid"] is None and probe["off_valid"] is None
    assert "use --transformer-impl local" in probe["with_te_layers"]
    assert "sequence parallelism" in probe["no_sp"]  # Megatron-LM's own rule, kept
    # --sft: packed where the tree's SFT dataset packs (core_v0.16 on), then refused with
    # Megatron's attention; core_v0.14's gives causal masks, which it runs
    assert probe["sft_valid"] is None
    assert probe["sft_packs"] == (not probe["version"].startswith("0.14")), probe["version"]
    if probe["sft_packs"]:
        assert "--sft packs documents" in probe["sft_megatron_attention"]
    else:
        assert probe["sft_megatron_attention"] is None
    assert probe["off_install"] == [{"ub_cfgs": None, "backend": "torch_p2p", "attention": "torch",
                        "fp8_scaling": "tensorwise", "fp8_fast_accum": "fprop", "fp8_fused_activation": True}]


def test_tp_communicator_init_calls_install_not_te(probe):
    assert probe["ours_init"] == {"calls": [{"ub_cfgs": "x.yaml", "backend": "auto", "attention": "torch",
                        "fp8_scaling": "tensorwise", "fp8_fast_accum": "fprop", "fp8_fused_activation": True}],
                                  "error": None, "te_imported": False}
    assert probe["no_cfg_init"]["calls"] == [{"ub_cfgs": None, "backend": "torch_p2p", "attention": "torch",
                        "fp8_scaling": "tensorwise", "fp8_fast_accum": "fprop", "fp8_fused_activation": True}]
    # te: Megatron-LM's own function, which needs Transformer Engine (absent on CPU)
    assert probe["te_init"]["calls"] == []
    if probe["te_init"]["error"] is not None:
        assert "transformer_engine" in probe["te_init"]["error"]


MODEL_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
              "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
              "--global-batch-size", "1", "--lr", "1e-4", "--train-iters", "1",
              "--tensor-model-parallel-size", "2", "--tokenizer-type", "NullTokenizer",
              "--vocab-size", "128", "--mock-data", "--distributed-backend", "gloo",
              "--transformer-impl", "local", "--sequence-parallel", "--no-persist-layer-norm",
              "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
              "--tp-comm-overlap-impl", "megatron_overlap", "--tp-comm-overlap-backend",
              "torch_p2p"]


def _model(tree: Path, *extra: str, world: int = 2, ok: bool = True, mock: bool = True) -> list:
    """Every rank's probe result; with `ok=False`, every rank's output of a run that must
    fail (returned, for the test to read the error). `mock=False`: without --mock-data
    (`extra` names the data)."""
    port = str(_free_port())
    base = [a for a in MODEL_ARGS if mock or a != "--mock-data"]
    procs = [_through_entry_point(tree, str(HELPERS / "megatron_lm_probe.py"), "model",
                                  *base, *extra, popen=True,
                                  env=_env(tree, MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                           WORLD_SIZE=str(world), RANK=str(r), LOCAL_RANK=str(r)))
             for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=600)[0])
    finally:
        for p in procs:
            p.kill() if p.poll() is None else None
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert (p.returncode == 0) == ok, f"rank {r}:\n{out[-8000:]}"
    if not ok:
        return outs
    return [_result(out, f"model probe rank {r}") for r, out in enumerate(outs)]


@pytest.fixture(scope="module")
def models(tree, tmp_path_factory) -> dict:
    cfg = tmp_path_factory.mktemp("ub") / "ub.yaml"
    cfg.write_text("fc2_fprop:\n  method: pipeline\n  num_sm: 8\n  num_splits: 2\n")
    return {"on": _model(tree, "--tp-comm-overlap", "--tp-comm-overlap-cfg", str(cfg)),
            "off": _model(tree), "cfg": str(cfg),
            "megatron_attention": _model(tree, "--tp-comm-overlap", "--megatron-overlap-attention",
                                         "megatron"),
            "fp8": _model(tree, "--tp-comm-overlap", *FP8),
            "fp8_recompute": _model(tree, "--tp-comm-overlap", *FP8, "--recompute-granularity",
                                    "full", "--recompute-method", "uniform",
                                    "--recompute-num-layers", "1"),
            "bf16": _model(tree, "--tp-comm-overlap", "--bf16"),
            "fp8_rowwise": _model(tree, "--tp-comm-overlap", "--bf16", *FP8, "--no-fp8-wgrad",
                                  "--megatron-overlap-fp8-scaling", "rowwise"),
            "sft": _model(tree, "--tp-comm-overlap", *_sft_args(tree, tmp_path_factory.mktemp("sft")),
                          mock=False),
            "fp8_delayed": _model(tree, "--tp-comm-overlap", "--fp8-format", "hybrid"),
            "fp8_delayed_recompute": _model(tree, "--tp-comm-overlap", "--fp8-format", "hybrid",
                                            "--recompute-granularity", "full",
                                            "--recompute-method", "uniform",
                                            "--recompute-num-layers", "1", ok=False),
            "fp8_no_overlap": _model(tree, *FP8, ok=False)}


FP8 = ("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise")


def _sft_args(tree: Path, directory: Path) -> list[str]:
    """Megatron-LM's --sft with conversations written for it into `directory`
    (benchmarks/sft_standins.py: short turns, so that a 512-token pack holds several), its
    SFTTokenizer on the stand-in Hugging Face tokenizer (through --legacy-tokenizer where
    the tree's megatron.core tokenizers have no SFT one: core_v0.16)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import sft_standins
    finally:
        sys.path.pop(0)
    path = directory / "sft.jsonl"
    # short enough that no pack is truncated (core_v0.16.1's truncation extends a list by an int)
    path.write_text("".join(json.dumps(c) + "\n" for c in sft_standins.conversations(8, 0, words=3)))
    return [*sft_standins.sft_args(tree, path), "--seq-length", "512",
            "--max-position-embeddings", "512"]


def test_model_provider_builds_our_layers_with_the_overlap_on(models, tree):
    for rank in models["on"]:
        assert Path(rank["pretrain_gpt"]).resolve() == tree / "pretrain_gpt.py"
        assert Path(rank["megatron_core"]).resolve().is_relative_to(tree)
        assert rank["install"] == [{"ub_cfgs": models["cfg"], "backend": "torch_p2p", "attention": "torch",
                        "fp8_scaling": "tensorwise", "fp8_fast_accum": "fprop", "fp8_fused_activation": True}]
        assert rank["installed"] == {"backend": "torch_p2p", "source": models["cfg"],
                                     "fc2_fprop_num_sm": 8}
        assert rank["linears"] == {
            "linear_qkv": ["OverlapColumnParallelLinear"] * 2,
            "linear_proj": ["OverlapRowParallelLinear"] * 2,
            "linear_fc1": ["OverlapColumnParallelLinear"] * 2,
            "linear_fc2": ["OverlapRowParallelLinear"] * 2}
        assert all(all(flags) for flags in rank["norms"].values())  # SP torch norms
        assert rank["te_imported"] is False
        # the core attention is torch's, and the dataloader's plain causal masks are not made
        assert rank["attention"] == ["TorchDotProductAttention"] * 2
        assert rank["dataloader_masks"] is False
        # packed sequences (THD, as the SFT path gives them) through that model: each token's
        # loss as with its document alone
        packed = rank["packed"]
        assert packed["shape"] == [1, 32] and packed["max_abs_diff"] <= 1e-5, packed
        assert "masked" in packed["ran"], packed  # (on CPU: SDPA with the document mask)


def test_sft_packs_conversations_that_our_layers_run_as_if_alone(models, probe):
    """--sft (core_v0.16 on, where its dataset packs): the tree's SFTTokenizer and
    SFTDataset (Hugging Face's loaders stood in for: benchmarks/sft_standins.py) pack several
    conversations into one 512-token sequence with cu_seqlens, prompts masked out of the
    loss; our layers and attention give each token the loss of its conversation alone."""
    for rank in models["sft"]:
        sft = rank["sft"]
        if not probe["sft_packs"]:  # core_v0.14: SFT sequences are not packed there
            assert sft["documents"] == 1, sft
            continue
        assert sft["tokenizer"] and sft["tokens"] == 512 and sft["documents"] >= 3, sft
        assert sft["loss_mask"] == [0.0, 1.0], sft  # system and user turns masked out
        assert sft["max_abs_diff"] <= 1e-5, sft


def test_model_provider_builds_megatron_s_layers_with_the_overlap_off(models):
    for rank in models["off"]:
        assert rank["install"] == [{"ub_cfgs": None, "backend": "torch_p2p", "attention": "torch",
                        "fp8_scaling": "tensorwise", "fp8_fast_accum": "fprop", "fp8_fused_activation": True}]
        assert rank["linears"] == {"linear_qkv": ["ColumnParallelLinear"] * 2,
                                   "linear_proj": ["RowParallelLinear"] * 2,
                                   "linear_fc1": ["ColumnParallelLinear"] * 2,
                                   "linear_fc2": ["RowParallelLinear"] * 2}
        assert all(all(flags) for flags in rank["norms"].values())


def test_same_loss_and_grads_on_and_off(models):
    for on, off in zip(models["on"], models["off"]):
        assert on["loss"] == pytest.approx(off["loss"], rel=1e-5)
        assert on["grad_norm_sum"] == pytest.approx(off["grad_norm_sum"], rel=1e-5)


def test_fp8_flags_run_fp8_in_our_linears(models):
    """--fp8-format hybrid --fp8-recipe tensorwise --transformer-impl local through the
    entry point: every overlapped linear runs FP8 (Megatron-LM builds the config from
    its own flags); the loss within 5e-3 of the same model without FP8 (fp32 params:
    the difference is FP8's rounding alone, see tests/test_fp8_model.py)."""
    for fp8, off in zip(models["fp8"], models["off"]):
        assert fp8["linears"] == models["on"][0]["linears"]
        assert len(fp8["precision"]) == 8 and all(
            p == "fp8 tensorwise (e4m3fn fprop, e5m2 grads, wgrad fp8, fast accumulation: fprop)"
            for p in fp8["precision"].values()), fp8["precision"]
        assert fp8["loss"] == pytest.approx(off["loss"], rel=5e-3) and fp8["loss"] != off["loss"]
        assert fp8["te_imported"] is False


def test_fp8_with_full_activation_recompute_trains_as_without(models):
    """--recompute-granularity full beside the FP8 flags, no Transformer Engine: megatron-core
    checkpoints an FP8 config's layers with TE's te_checkpoint (None here); through the
    entry point they run Megatron's own checkpoint instead, to the same loss, bit for bit."""
    for again, fp8 in zip(models["fp8_recompute"], models["fp8"]):
        assert again["precision"] == fp8["precision"]
        assert again["loss"] == fp8["loss"] and again["te_imported"] is False


def test_rowwise_fp8_flags_run_rowwise_fp8_in_our_linears(models):
    """--megatron-overlap-fp8-scaling rowwise --no-fp8-wgrad --bf16 beside the FP8 flags:
    install() gets the setting, every overlapped linear runs row-wise FP8, the loss within
    5e-3 of the same bf16 model without FP8."""
    for rw, bf16 in zip(models["fp8_rowwise"], models["bf16"]):
        assert rw["install"][0]["fp8_scaling"] == "rowwise"
        assert len(rw["precision"]) == 8 and all(
            p == "fp8 rowwise (e4m3fn fprop, e5m2 grads, wgrad high precision, fast accumulation: fprop)"
            for p in rw["precision"].values()), rw["precision"]
        assert rw["loss"] == pytest.approx(bf16["loss"], rel=5e-3) and rw["loss"] != bf16["loss"]
        assert rw["te_imported"] is False


def test_fp8_with_megatron_lm_s_default_recipe_runs_delayed_scaling(models):
    """--fp8-format alone leaves --fp8-recipe at delayed (Megatron-LM's default: one amax,
    the most recent): every overlapped linear runs delayed scaling, the loss within 5e-3
    of the model without FP8; under full recompute it stops at start-up, naming the
    reason and the recipe that runs. FP8 without --tp-comm-overlap stops at validation."""
    for delayed, off in zip(models["fp8_delayed"], models["off"]):
        assert len(delayed["precision"]) == 8 and all(
            p.startswith("fp8 delayed (e4m3fn fprop, e5m2 grads, wgrad fp8, amax history 1 "
                         "(most_recent), margin 0") for p in delayed["precision"].values()), \
            delayed["precision"]
        assert delayed["loss"] == pytest.approx(off["loss"], rel=5e-3)
        assert delayed["loss"] != off["loss"] and delayed["te_imported"] is False
    for out in models["fp8_delayed_recompute"]:
        assert "ConfigError" in out and "fp8_recipe='delayed'" in out, out[-4000:]
        assert "activation recompute (full)" in out and "fp8_recipe='tensorwise'" in out
    for out in models["fp8_no_overlap"]:  # Megatron's linears would run it in bf16
        assert "with --tp-comm-overlap-impl megatron_overlap needs --tp-comm-overlap" in out, \
            out[-4000:]


def test_megatron_overlap_attention_megatron_keeps_megatrons_attention_with_the_same_loss(models):
    for torch_attn, megatron_attn in zip(models["on"], models["megatron_attention"]):
        assert megatron_attn["install"][0]["attention"] == "megatron"
        assert megatron_attn["attention"] == ["DotProductAttention"] * 2
        assert megatron_attn["dataloader_masks"] is True  # Megatron-LM's default, untouched
        assert torch_attn["loss"] == pytest.approx(megatron_attn["loss"], rel=1e-5)
        assert torch_attn["grad_norm_sum"] == pytest.approx(megatron_attn["grad_norm_sum"], rel=1e-5)


# --- the GPU parity run's log check (benchmarks/megatron_lm_parity.py) ------------------------

def _log(path: Path, arm: str, losses: list[str], attention: str = "torch", packed: int = 0) -> Path:
    why = "--tp-comm-overlap" if arm == "on" else "every overlap off (no --tp-comm-overlap)"
    lines = [f"megatron_overlap.megatron_lm: megatron_overlap.install(ub_cfgs=None, "
             f"backend='symm', attention={attention!r}): {why} [Megatron-LM with megatron-core 0.16.1 (at /x)]"]
    lines += [f" [2026-12-03 15:00:00] iteration {i:8d}/{len(losses):8d} | consumed samples: "
              f"{2 * i:12d} | elapsed time per iteration (ms): 120.{i} | learning rate: "
              f"3.000000E-04 | lm loss: {loss} | loss scale: 1.0 | grad norm: 3.21{i} |"
              for i, loss in enumerate(losses, 1)]
    built = ', "OverlapColumnParallelLinear": 8, "OverlapRowParallelLinear": 8' if arm == "on" else ""
    built += ', "TorchDotProductAttention": 4' if attention == "torch" else ""
    built += f', "packed_attention_calls": {packed}' if packed else ""
    lines.append('MLM-PARITY-LAYERS {"rank": 0%s}' % built)
    if arm == "on":  # both ranks' notes on one line, as ranks sharing a terminal print them
        lines.append('MLM-REPLAYS {"rank": 1, "per_iter": [[32, 0, 0, 0], [32, 0, 16, 0], [32, 32, 0, 0]]}'
                     'MLM-REPLAYS {"rank": 0, "per_iter": [[32, 0, 0, 0], [32, 0, 16, 0], [32, 30, 1, 1]]}')
    path.write_text("\n".join(lines) + "\n")
    return path


def _parity():
    """benchmarks/megatron_lm_parity.py, the GPU parity run's log check."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import megatron_lm_parity
    finally:
        sys.path.pop(0)
    return megatron_lm_parity


def test_parity_check_of_two_logs(tmp_path, capsys):
    parity = _parity()
    losses = ["9.011234E+00", "8.912345E+00", "8.800001E+00"]
    on, off = _log(tmp_path / "on.log", "on", losses), _log(tmp_path / "off.log", "off", losses)
    assert parity.main([str(on), str(off), "--iters", "3", "--label", "t"]) == 0
    out = capsys.readouterr().out
    assert "PARITY OK" in out
    assert ("layer passes replayed / run per iteration (on): rank 0: 0/32 0/32 30/32 (captures 17, "
            "evictions 1); rank 1: 0/32 0/32 32/32 (captures 16, evictions 0)") in out
    _log(on, "on", losses[:1] + ["8.912346E+00"] + losses[2:])
    assert parity.main([str(on), str(off), "--iters", "3"]) == 1
    assert "iteration 2: lm loss 8.912346E+00 (on) != 8.912345E+00 (off)" in capsys.readouterr().out
    assert parity.main([str(off), str(off), "--iters", "3"]) == 1  # "on" built no layer of ours
    assert parity.main([str(on), str(on), "--iters", "4"]) == 1  # iteration 4 missing
    # two runs of Megatron's linears (graphed against eager): their losses alone
    assert parity.main([str(off), str(off), "--iters", "3", "--losses-only"]) == 0
    _log(on, "off", losses[:2] + ["8.800002E+00"])
    assert parity.main([str(on), str(off), "--iters", "3", "--losses-only"]) == 1


def test_attention_parity_check_of_two_logs(tmp_path, capsys):
    """--attention: torch's attention against Megatron's, both overlapped: losses within the
    relative tolerance, our attention built in the first run only."""
    parity = _parity()
    ours = _log(tmp_path / "ours.log", "on", ["9.011234E+00", "8.912345E+00"])
    theirs = _log(tmp_path / "theirs.log", "on", ["9.011300E+00", "8.910000E+00"], attention="megatron")
    assert parity.main([str(ours), str(theirs), "--iters", "2", "--attention"]) == 0
    assert "PARITY OK" in capsys.readouterr().out
    assert parity.main([str(ours), str(theirs), "--iters", "2", "--attention", "--rel-tol", "1e-5"]) == 1
    assert "beyond 1e-05 relative" in capsys.readouterr().out
    assert parity.main([str(ours), str(ours), "--iters", "2", "--attention"]) == 1  # no Megatron arm
    out = capsys.readouterr().out
    assert "second: megatron_overlap.install was not called with attention='megatron'" in out
    assert "second: 4 TorchDotProductAttention built" in out
    _log(theirs, "on", ["9.5E+00", "8.910000E+00"], attention="megatron")
    assert parity.main([str(ours), str(theirs), "--iters", "2", "--attention"]) == 1


def test_packed_parity_check_of_two_logs(tmp_path, capsys):
    """--packed: equal losses, and both runs called our attention with packed sequences."""
    parity = _parity()
    losses = ["9.011234E+00", "8.912345E+00"]
    on = _log(tmp_path / "on.log", "on", losses, packed=48)
    off = _log(tmp_path / "off.log", "off", losses, packed=48)
    assert parity.main([str(on), str(off), "--iters", "2", "--packed"]) == 0
    assert "PARITY OK" in capsys.readouterr().out
    _log(off, "off", losses)  # the off run never packed: not the comparison asked for
    assert parity.main([str(on), str(off), "--iters", "2", "--packed"]) == 1
    assert "off: rank 0 ran no packed attention call" in capsys.readouterr().out
