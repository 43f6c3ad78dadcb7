"""python -m megatron_overlap.megatron_lm SCRIPT [ARGS...]: run a Megatron-LM
training script (pretrain_gpt.py, ...) unchanged, with the hooks installed."""

from __future__ import annotations

import os
import runpy
import sys

USAGE = """usage: python -m megatron_overlap.megatron_lm SCRIPT [Megatron-LM args...]
  (or: torchrun [torchrun args] -m megatron_overlap.megatron_lm SCRIPT [...])

Runs SCRIPT (e.g. Megatron-LM's pretrain_gpt.py) as `python SCRIPT ...` would, with
three more flags in Megatron-LM's parser:
  --tp-comm-overlap-impl {te,megatron_overlap}   default te (Transformer Engine)
  --tp-comm-overlap-backend {auto,torch_p2p,symm,nvshmem}
  --megatron-overlap-attention {torch,megatron}  default torch (torch's fused attention)
With --tp-comm-overlap --tp-comm-overlap-impl megatron_overlap (needs
--transformer-impl local and --sequence-parallel), megatron_overlap.install() replaces
TE's Userbuffers; --tp-comm-overlap-cfg is read as its ub_cfgs. Under
--tp-comm-overlap-impl megatron_overlap the local spec's core attention is torch's fused
attention unless --megatron-overlap-attention megatron (or --attention-backend unfused).
`SCRIPT --help` lists every flag."""


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        raise SystemExit(0 if argv else 2)
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        raise SystemExit(f"megatron_overlap.megatron_lm: no such script: {argv[0]}")
    tree = os.path.dirname(script)
    # As `python SCRIPT` does: the script's folder first, so its megatron/ is imported.
    sys.path.insert(0, tree)
    ours, core = os.path.join(tree, "megatron", ""), sys.modules.get("megatron.core")
    if core is not None and os.path.isdir(ours) and \
            not os.path.realpath(core.__file__ or "").startswith(os.path.realpath(ours) + os.sep):
        raise SystemExit(f"megatron_overlap.megatron_lm: megatron.core was imported from "
                         f"{core.__file__} before {script} could use {ours}")

    from .hooks import UnsupportedMegatronLM, install_hooks

    try:
        install_hooks()
    except UnsupportedMegatronLM as e:  # a start-up refusal, not a crash: no traceback
        raise SystemExit(f"error: {e}") from None
    sys.argv = [script, *argv[1:]]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
