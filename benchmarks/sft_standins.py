"""Stand-ins for the two Hugging Face libraries Megatron-LM's `--sft` path loads its data
with, for runs where they are not installed (`datasets` needs pyarrow, more than a device
call carries) or cannot reach the hub (the GPU machine has `transformers`, no network).
Everything else of `--sft` is Megatron-LM's own: its SFTTokenizer (prompt format, target
masking), SFTDataset (packing conversations into sequences with cu_seqlens), get_batch and
the training loop.

- `datasets.load_dataset("json", data_files=PATH, split="all")`: the JSON lines of PATH,
  each a dict (Megatron reads `[i]["messages"]`).
- `transformers.AutoTokenizer.from_pretrained(PATH)`: a byte-level tokenizer (PATH is not
  read): ids 0-255 are UTF-8 bytes, then the special tokens Megatron's SFT prompt formats
  name (`SPECIALS`); `apply_chat_template` renders the Jinja template it is given (with
  jinja2, which torch requires) and tokenizes the text, specials first.

    python benchmarks/sft_standins.py OUT.jsonl [--conversations 64] [--seed 0]

writes conversations (system, user, assistant turns of random words) for `--data-path`.
`install()` puts them in place (`datasets` where the real one does not import; the
tokenizer always; benchmarks/megatron_lm_shared_gpu.py calls it for `--sft`).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import types
from pathlib import Path
from typing import Any

SPECIALS = ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<SPECIAL_233>", "<unk>", "</s>")
_SPLIT = re.compile("(" + "|".join(map(re.escape, SPECIALS)) + ")")


class ByteTokenizer:
    """What Megatron-LM's SFTTokenizer calls of a Hugging Face tokenizer."""

    bos_token_id = None
    pad_token_id = None
    chat_template = None

    def __init__(self) -> None:
        self.specials = {t: 256 + i for i, t in enumerate(SPECIALS)}
        self.eos_token_id = self.specials["</s>"]

    def __len__(self) -> int:
        return 256 + len(SPECIALS)

    def convert_tokens_to_ids(self, tokens):
        return ([self.specials[t] for t in tokens] if isinstance(tokens, list)
                else self.specials[tokens])

    def get_added_vocab(self) -> dict[str, int]:
        return dict(self.specials)

    def encode(self, text: str) -> list[int]:
        return [i for part in _SPLIT.split(text) if part
                for i in ([self.specials[part]] if part in self.specials else part.encode())]

    def decode(self, ids) -> str:
        inverse = {v: k for k, v in self.specials.items()}
        out, raw = [], bytearray()
        for i in ids:
            if int(i) in inverse:
                out.append(raw.decode(errors="replace") + inverse[int(i)])
                raw = bytearray()
            else:
                raw.append(int(i))
        return "".join(out) + raw.decode(errors="replace")

    def apply_chat_template(self, conversation, tokenize: bool = True,
                            add_generation_prompt: bool = False, chat_template: str | None = None,
                            return_tensors: str | None = None, **_: Any):
        import jinja2

        text = jinja2.Template(chat_template or "").render(
            messages=conversation, add_generation_prompt=add_generation_prompt)
        if not tokenize:
            return text
        ids = self.encode(text)
        if return_tensors == "np":
            import numpy as np

            return np.array([ids], dtype=np.int64)
        return ids


def load_dataset(kind: str, data_files: str, split: str = "all") -> list[dict]:
    if kind != "json":
        raise ValueError(f"sft_standins.load_dataset: {kind!r}: JSON lines only")
    with open(data_files) as f:
        return [json.loads(line) for line in f if line.strip()]


def install() -> list[str]:
    """Stand in for `datasets` where it does not import, and for `transformers`'
    `AutoTokenizer` always: the runs name their tokenizer 'standin', which no hub holds,
    and a real transformers (the GPU machine has one) would look it up online and fail
    there. Returns what was stood in for."""
    made = []
    try:
        __import__("datasets")
    except ImportError:
        _module("datasets", load_dataset=load_dataset)
        made.append("datasets")
    tokenizer = types.SimpleNamespace(from_pretrained=lambda *a, **k: ByteTokenizer())
    try:
        transformers = __import__("transformers")
    except ImportError:
        _module("transformers", AutoTokenizer=tokenizer)
        made.append("transformers")
    else:  # Megatron-LM reads `transformers.AutoTokenizer` when it builds the tokenizer
        transformers.AutoTokenizer = tokenizer
        made.append("transformers.AutoTokenizer")
    print(f"MLM-SFT-STANDINS {', '.join(made)} (benchmarks/sft_standins.py)", flush=True)
    return made


def _module(name: str, **attrs: Any) -> None:
    module = types.ModuleType(name)
    module.__dict__.update(attrs, __version__="0-standin")
    sys.modules[name] = module


def conversations(n: int, seed: int, words: int = 40) -> list[dict]:
    """`n` JSON lines, each two or three conversations packed as Megatron's SFT reads them
    (each conversation opened by its system message); a turn has up to `words` words."""
    rng = random.Random(seed)
    vocab = [w * rng.randint(1, 3) for w in ("alpha", "beta", "gamma", "delta", "omega", "zeta")]
    say = lambda k: " ".join(rng.choice(vocab) for _ in range(max(1, k)))  # noqa: E731
    lines = []
    for _ in range(n):
        messages = []
        for _ in range(rng.randint(2, 3)):
            messages += [{"role": "system", "content": say(rng.randint(1, max(1, words // 8)))},
                         {"role": "user", "content": say(rng.randint(2, words))},
                         {"role": "assistant", "content": say(rng.randint(2, words))}]
        lines.append({"messages": messages})
    return lines


def sft_packs(tree: str | Path) -> bool:
    """Whether a Megatron-LM tree's SFT dataset packs conversations into sequences with
    cu_seqlens (core_v0.16 on; core_v0.14's returns one conversation with causal masks)."""
    dataset = Path(tree) / "megatron/training/datasets/sft_dataset.py"
    return dataset.is_file() and "cu_seqlens" in dataset.read_text()


def sft_args(tree: str | Path, data_path: str | Path) -> list[str]:
    """Megatron-LM's `--sft` flags for a tree on the conversations at `data_path`, its
    SFTTokenizer on the stand-in tokenizer (through `--legacy-tokenizer` where the tree's
    megatron.core tokenizers have no SFT one: core_v0.16)."""
    tree = Path(tree)
    builders = [*tree.glob("megatron/core/tokenizers/*/build_tokenizer.py"),
                *tree.glob("megatron/core/tokenizers/*/*/build_tokenizer.py")]
    # (core_v0.14 has no megatron.core tokenizers, nor --legacy-tokenizer)
    legacy = bool(builders) and not any("SFTTokenizer" in f.read_text() for f in builders)
    return ["--sft", "--tokenizer-type", "SFTTokenizer", "--tokenizer-model", "standin",
            "--data-path", str(data_path), "--split", "100,0,0",
            *(["--legacy-tokenizer"] if legacy else [])]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--conversations", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--words", type=int, default=40, help="most words in a turn")
    ap.add_argument("--args-for", metavar="TREE",
                    help="print only TREE's --sft flags on OUT (nothing, and no OUT written, "
                         "where its SFT dataset does not pack sequences)")
    a = ap.parse_args(argv)
    if a.args_for and not sft_packs(a.args_for):
        return 0
    flags = sft_args(a.args_for, a.out) if a.args_for else None
    with open(a.out, "w") as f:
        for line in conversations(a.conversations, a.seed, a.words):
            f.write(json.dumps(line) + "\n")
    print(" ".join(flags) if flags else f"{a.conversations} lines of conversations: {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
