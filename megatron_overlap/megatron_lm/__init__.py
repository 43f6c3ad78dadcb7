"""Megatron-LM's training scripts with megatron_overlap, without a source patch:

    torchrun ... -m megatron_overlap.megatron_lm pretrain_gpt.py <Megatron-LM args> \\
        --tp-comm-overlap --tp-comm-overlap-impl megatron_overlap --sequence-parallel \\
        --transformer-impl local [--tp-comm-overlap-backend auto|torch_p2p|symm|nvshmem] \\
        [--tp-comm-overlap-cfg FILE]

`hooks` wraps Megatron-LM's argument parsing, validation and TP-communicator setup;
`__main__` puts the script's tree first on sys.path, installs the hooks and runs the
script unchanged. Owns the hooks and the flags they add. Imports `config` (the
backend names) and nothing else of ours at import; never megatron, torch or the
integration at import: `megatron_overlap.install` is loaded inside the TP-communicator
hook, once the script's tree is first on sys.path.
"""

from .hooks import UnsupportedMegatronLM, install_hooks, uninstall_hooks

__all__ = ["UnsupportedMegatronLM", "install_hooks", "uninstall_hooks"]
