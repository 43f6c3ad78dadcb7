"""Per-GEMM overlap settings in Transformer Engine's ``ub_cfgs`` format.

Loads TE/NeMo/Megatron userbuffers YAML (or a dict, or nothing for TE's
defaults), validates it with TE's rules, and reports which keys a backend of
this package ignores. Knows nothing of torch.

    cfg = OverlapConfig.load("ub_cfg.yaml")
    cfg["proj_fprop"].splits(tp_size=8)
    print(cfg.table("torch_p2p", tp_size=8))
"""

from .errors import ConfigError, UnknownLayerError
from .backends import BACKENDS, CHOICES, COMPOSITE, INTER_BACKENDS, REGISTRY, Backend
from .names import BUFFER_NAMES, COLUMN_BUFFERS, PASSES, ROW_BUFFERS, EXTENSION_KEYS, KEYS, LAYER_NAMES, METHODS, RING_ORDERS
from .overlap import OverlapConfig
from .settings import LayerSettings

__all__ = [
    "BUFFER_NAMES", "COLUMN_BUFFERS", "ROW_BUFFERS", "PASSES",
    "REGISTRY", "Backend", "COMPOSITE", "INTER_BACKENDS", "CHOICES",
    "LAYER_NAMES", "METHODS", "BACKENDS", "KEYS", "EXTENSION_KEYS", "RING_ORDERS",
    "ConfigError", "UnknownLayerError", "LayerSettings", "OverlapConfig",
]
