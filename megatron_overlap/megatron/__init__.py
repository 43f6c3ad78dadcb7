"""Megatron integration: install()/uninstall(), the swap at model construction,
sequence-parallel torch norms, and overlap_layer_spec() for explicit specs.

Owns: patching and restoring Megatron's classes, reading its config flags. Imports
`config`, `comm`, `overlap` (knobs only: graphs, GEMM streams) and `layers`. Must
not import the tools (telemetry, simulate, tune, ab, cli) or a tool's extra.
"""

from .install import install, uninstall
from .swap import overlap_layer_spec

__all__ = ["install", "uninstall", "overlap_layer_spec"]
