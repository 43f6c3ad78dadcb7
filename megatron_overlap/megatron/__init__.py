"""Megatron integration: install()/uninstall() and the state layers read."""

from .install import install, uninstall

__all__ = ["install", "uninstall"]
