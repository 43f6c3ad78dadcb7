"""Megatron's own CUDA graphs over the overlapped layers.

Megatron-core graphs a transformer layer (or a whole iteration) itself when its
config asks (`cuda_graph_impl="local"`: its CudaGraphManager; `enable_cuda_graph`
before 0.16). Our passes are then captured inside Megatron's graph, and our own
per-pass graphs (overlap.replay) stand aside: a capture cannot nest, and two
graphs of one pass would hold its scratch twice. Transformer Engine's graphing
(`cuda_graph_impl="transformer_engine"`, `external_cuda_graph`) is refused when
the layer is built: it graphs through TE's make_graphed_callables and TE's module
state, which layers that replace TE's do not have.
"""

from __future__ import annotations

from typing import Any, Optional

from ..config import ConfigError


def megatron_graphs(config: Any, layer: str) -> Optional[str]:
    """The Megatron CUDA-graph implementation that captures this layer ("local",
    "full_iteration"), or None when Megatron graphs nothing; raises ConfigError,
    naming the setting, for one the overlapped layers cannot run under."""
    impl = getattr(config, "cuda_graph_impl", None)
    if getattr(config, "external_cuda_graph", False) and impl in (None, "none"):
        impl = "transformer_engine"  # megatron-core < 0.16 spelling
    if getattr(config, "enable_cuda_graph", False) and impl in (None, "none"):
        impl = "local"
    if impl in (None, "none"):
        return None
    if impl == "transformer_engine":
        setting = ("external_cuda_graph=True" if getattr(config, "external_cuda_graph", False)
                   else "cuda_graph_impl='transformer_engine'")
        raise ConfigError(
            f"megatron_overlap: layer {layer!r}: {setting} graphs the model through Transformer "
            "Engine's make_graphed_callables, which the overlapped layers (they replace TE's) "
            "do not support; use cuda_graph_impl='local' (Megatron's CudaGraphManager; "
            "enable_cuda_graph=True before megatron-core 0.16), or turn tp_comm_overlap off",
            layer=layer, key="cuda_graph_impl", value=impl)
    scope = getattr(config, "cuda_graph_scope", None) or []
    scopes = [getattr(s, "name", s) for s in (scope if isinstance(scope, (list, tuple)) else [scope])]
    return "full_iteration" if impl == "full_iteration" or "full_iteration" in scopes else impl
