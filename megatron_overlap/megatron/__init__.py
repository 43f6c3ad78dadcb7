"""Megatron integration: install()/uninstall(), the swap at model construction,
sequence-parallel torch norms, and overlap_layer_spec() for explicit specs."""

from .install import install, uninstall
from .swap import overlap_layer_spec

__all__ = ["install", "uninstall", "overlap_layer_spec"]
