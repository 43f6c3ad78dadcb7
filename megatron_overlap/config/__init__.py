"""Per-GEMM overlap settings in Transformer Engine's ``ub_cfgs`` format.

Owns: the vocabulary (`names`: layer, buffer and pass names, keys, TE's
defaults), the backend registry (`backends`), loading TE/NeMo/Megatron
userbuffers YAML (or a dict, or nothing for TE's defaults) with TE's validation
rules, which keys a backend ignores (`effects`), the settings `install()` put in
force (`state`), and the one console-table renderer (`console`, `table`).
Must not import torch, megatron-core, any other megatron_overlap package, or a
tool's extra (wandb, rich, matplotlib).

    cfg = OverlapConfig.load("ub_cfg.yaml")
    cfg["proj_fprop"].splits(tp_size=8)
    print(cfg.table("torch_p2p", tp_size=8))
"""

from .backends import BACKENDS, CHOICES, COMPOSITE, INTER_BACKENDS, REGISTRY, Backend
from .errors import ConfigError, UnknownLayerError
from .names import (BUFFER_NAMES, COLUMN_BUFFERS, EXTENSION_KEYS, KEYS, LAYER_NAMES, METHODS,
                    PASSES, RING_ORDERS, ROW_BUFFERS)
from .overlap import OverlapConfig
from .settings import LayerSettings

__all__ = [
    "BUFFER_NAMES", "COLUMN_BUFFERS", "ROW_BUFFERS", "PASSES",
    "REGISTRY", "Backend", "COMPOSITE", "INTER_BACKENDS", "CHOICES",
    "LAYER_NAMES", "METHODS", "BACKENDS", "KEYS", "EXTENSION_KEYS", "RING_ORDERS",
    "ConfigError", "UnknownLayerError", "LayerSettings", "OverlapConfig",
]
