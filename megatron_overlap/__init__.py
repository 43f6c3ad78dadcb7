"""megatron_overlap: tensor-parallel communication hidden under the GEMMs of
Megatron-core models.

    import megatron_overlap
    megatron_overlap.install(ub_cfgs="overlap.yaml")   # or a dict, or None
"""

from .megatron import install, overlap_layer_spec, uninstall

__version__ = "0.1.0"
__all__ = ["install", "uninstall", "overlap_layer_spec", "__version__"]
