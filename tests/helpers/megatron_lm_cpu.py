"""Run a real Megatron-LM tree's start-up on CPU, for tests only.

    python tests/helpers/megatron_lm_cpu.py SCRIPT [ARGS...]

is `python -m megatron_overlap.megatron_lm SCRIPT [ARGS...]` with one test-side
shim first: a Megatron module whose import fails only because an optional
third-party package is missing here (`triton` for GPU kernels such as the MoE
paged stash, `six` / `regex` for the BERT / GPT-2 tokenizers) is replaced by a
placeholder module, and its name is printed (`MLM-CPU-STUBBED name`). Argument
parsing and building a local-spec model never run those modules. A stub for
`triton` itself would fool torch into thinking Triton is there, so none is made.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import runpy
import sys
import types

OPTIONAL = ("triton", "six", "regex")
STUBBED: list[str] = []


class _Anything:
    """Stands for whatever a stubbed module defines: callable, decorator, attribute."""

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else self

    def __getattr__(self, name: str) -> "_Anything":
        return self

    def __mro_entries__(self, bases):  # `class X(stubbed.Base)` still works
        return (object,)


class _StubOnMissingOptional(importlib.abc.MetaPathFinder):
    """Wraps the loader of every megatron.* module so that a ModuleNotFoundError for
    one of OPTIONAL turns that module into a placeholder."""

    def find_spec(self, name, path, target=None):
        if not name.startswith("megatron."):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        real = spec.loader

        class Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return real.create_module(spec)

            def exec_module(self, module):
                try:
                    real.exec_module(module)
                except ModuleNotFoundError as e:
                    if (e.name or "").split(".")[0] not in OPTIONAL:
                        raise
                    STUBBED.append(f"{name} (needs {e.name})")
                    print(f"MLM-CPU-STUBBED {name} (needs {e.name})", flush=True)
                    module.__getattr__ = lambda attr: _Anything()  # type: ignore[attr-defined]

        spec.loader = Loader()
        return spec


def install() -> None:
    import typing

    if not hasattr(typing, "override"):  # Python < 3.12: PEP 698's marker, nothing more
        typing.override = lambda f: f  # type: ignore[attr-defined]
        print("MLM-CPU-STUBBED typing.override (Python < 3.12)", flush=True)
    if not any(isinstance(f, _StubOnMissingOptional) for f in sys.meta_path):
        sys.meta_path.insert(0, _StubOnMissingOptional())


if __name__ == "__main__":
    install()
    os.environ.setdefault("NO_VCS_VERSION", "1")  # main's package_info would call git
    sys.argv = ["megatron_overlap.megatron_lm", *sys.argv[1:]]
    runpy.run_module("megatron_overlap.megatron_lm", run_name="__main__", alter_sys=True)
