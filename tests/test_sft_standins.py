"""benchmarks/sft_standins.py's --sft flags for a Megatron-LM tree, on stand-in trees
holding only the files it reads (the real trees: tests/test_megatron_lm.py)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import sft_standins  # noqa: E402

sys.path.pop(0)

SFT = "megatron/training/datasets/sft_dataset.py"


def _tree(root: Path, packs: bool, builder: str | None, sft_tokenizer: bool) -> Path:
    (root / SFT).parent.mkdir(parents=True)
    (root / SFT).write_text("cu_seqlens = ...\n" if packs else "attention_mask = ...\n")
    if builder:
        (root / builder).parent.mkdir(parents=True)
        (root / builder).write_text("SFTTokenizer\n" if sft_tokenizer else "GPT2BPETokenizer\n")
    return root


@pytest.mark.parametrize("packs, builder, sft_tokenizer, legacy", [
    (False, None, False, False),  # core_v0.14: no packing, no megatron.core tokenizers
    (True, "megatron/core/tokenizers/text/utils/build_tokenizer.py", False, True),  # core_v0.16
    (True, "megatron/core/tokenizers/utils/build_tokenizer.py", True, False),  # core_v0.19
])
def test_sft_flags_for_each_tree_layout(tmp_path, packs, builder, sft_tokenizer, legacy):
    tree = _tree(tmp_path / "tree", packs, builder, sft_tokenizer)
    assert sft_standins.sft_packs(tree) is packs
    flags = sft_standins.sft_args(tree, tmp_path / "d.jsonl")
    assert flags[:2] == ["--sft", "--tokenizer-type"] and str(tmp_path / "d.jsonl") in flags
    assert ("--legacy-tokenizer" in flags) is legacy
    out = tmp_path / "out.jsonl"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks/sft_standins.py"), str(out),
                        "--conversations", "3", "--args-for", str(tree)],
                       capture_output=True, text=True, check=True)
    # the shell scripts' contract: the flags on one line where the tree packs, else nothing
    assert r.stdout.split() == (sft_standins.sft_args(tree, out) if packs else [])
    assert out.exists() is packs and (not packs or len(out.read_text().splitlines()) == 3)


def test_install_stands_in_for_the_tokenizer_with_or_without_transformers(monkeypatch):
    """The runs' tokenizer ('standin') exists on no hub: a real transformers (the GPU
    machine's) gets its AutoTokenizer replaced, an absent one a module of its own;
    `datasets` is stood in for only where it does not import."""
    import types

    real = types.ModuleType("transformers")
    real.AutoTokenizer = object()
    monkeypatch.setitem(sys.modules, "transformers", real)
    monkeypatch.setitem(sys.modules, "datasets", types.ModuleType("datasets"))
    assert sft_standins.install() == ["transformers.AutoTokenizer"]
    assert sys.modules["transformers"] is real
    assert isinstance(real.AutoTokenizer.from_pretrained("standin"), sft_standins.ByteTokenizer)

    monkeypatch.setitem(sys.modules, "transformers", None)  # None: `import` raises ImportError
    monkeypatch.setitem(sys.modules, "datasets", None)
    assert sft_standins.install() == ["datasets", "transformers"]
    tok = sys.modules["transformers"].AutoTokenizer.from_pretrained("standin")
    assert tok.encode("ab</s>") == [97, 98, tok.eos_token_id]
    assert sys.modules["datasets"].load_dataset is sft_standins.load_dataset
