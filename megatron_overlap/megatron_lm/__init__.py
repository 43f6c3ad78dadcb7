"""Megatron-LM's training scripts with megatron_overlap, without a source patch:

    torchrun ... -m megatron_overlap.megatron_lm pretrain_gpt.py <Megatron-LM args> \\
        --tp-comm-overlap --tp-comm-overlap-impl megatron_overlap --sequence-parallel \\
        --transformer-impl local [--tp-comm-overlap-backend auto|torch_p2p|symm|nvshmem] \\
        [--tp-comm-overlap-cfg FILE]

`hooks` wraps Megatron-LM's argument parsing, validation and TP-communicator setup;
`__main__` puts the script's tree first on sys.path, installs the hooks and runs the
script unchanged. Importing this package imports no megatron.
"""

from .hooks import UnsupportedMegatronLM, install_hooks, uninstall_hooks

__all__ = ["UnsupportedMegatronLM", "install_hooks", "uninstall_hooks"]
