"""megatron_overlap: tensor-parallel communication hidden under the GEMMs of
Megatron-core models.

    import megatron_overlap
    megatron_overlap.install(ub_cfgs="overlap.yaml")   # or a dict, or None

The runtime (`config`, `comm`, `overlap`, `layers`, `megatron`) needs torch and
megatron-core alone; the tools (`telemetry`, `simulate`, `tune`, `ab`, `cli`) may
need extras (`pip install 'megatron-overlap[tools]'`, `extras.require`). Importing a
subpackage imports only what it needs, and importing the package imports no
megatron-core: `install` / `uninstall` / `overlap_layer_spec` load the Megatron
integration on first use, so that `python -m megatron_overlap.megatron_lm
pretrain_gpt.py ...` can put that script's Megatron-LM tree first on sys.path.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"
__all__ = ["install", "uninstall", "overlap_layer_spec", "__version__"]
_INTEGRATION = ("install", "uninstall", "overlap_layer_spec")


def __getattr__(name: str) -> Any:
    if name in _INTEGRATION:
        from . import megatron

        return getattr(megatron, name)
    raise AttributeError(f"module 'megatron_overlap' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_INTEGRATION))
