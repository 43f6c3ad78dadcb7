"""megatron_overlap: tensor-parallel communication hidden under the GEMMs of
Megatron-core models.

    import megatron_overlap
    megatron_overlap.install(ub_cfgs="overlap.yaml")   # or a dict, or None

Importing the package imports no megatron-core: `install`, `uninstall` and
`overlap_layer_spec` load it on first use, so that `python -m
megatron_overlap.megatron_lm pretrain_gpt.py ...` can put that script's
Megatron-LM tree first on sys.path before megatron is imported.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["install", "uninstall", "overlap_layer_spec", "__version__"]
_LAZY = ("install", "uninstall", "overlap_layer_spec")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from . import megatron as _integration

        return getattr(_integration, name)
    raise AttributeError(f"module 'megatron_overlap' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
