"""Optional dependencies of the tools (and of FP8 in the layers: torchao), each
installed by one extra of the package.

The runtime needs torch and megatron-core alone; a feature that needs more imports it
through `require`, which names the extra when the module is missing:

    wandb = require("wandb", "OverlapTelemetry(run)")
    # ImportError: OverlapTelemetry(run) needs wandb: pip install 'megatron-overlap[wandb]'

Imports nothing of megatron_overlap.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# top-level module -> the extra (pyproject.toml [project.optional-dependencies]) that installs it
EXTRAS: dict[str, str] = {"wandb": "wandb", "rich": "tools", "matplotlib": "ab", "torchao": "fp8"}


class MissingExtra(ImportError):
    """A tool's optional dependency is not installed; the message says which extra installs it."""


def install_hint(module: str) -> str:
    """"pip install 'megatron-overlap[wandb]'" for a module of EXTRAS."""
    return f"pip install 'megatron-overlap[{EXTRAS[module.partition('.')[0]]}]'"


def require(module: str, feature: str) -> ModuleType:
    """import_module(module), or MissingExtra naming `feature` and the extra to install.
    `module` may be a submodule ("rich.progress"); its top-level package is in EXTRAS."""
    top = module.partition(".")[0]
    if top not in EXTRAS:
        raise KeyError(f"megatron_overlap.extras: {top!r} is not an optional dependency "
                       f"(known: {', '.join(EXTRAS)})")
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name is not None and exc.name.partition(".")[0] != top:
            raise  # the module is there but one of its own imports failed
        raise MissingExtra(f"{feature} needs {top}, which is not installed: "
                           f"{install_hint(top)}") from exc
