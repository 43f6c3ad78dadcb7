"""GPU tests: several ranks share one GPU through torch symmetric memory (gloo
process group, TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1). `make test-gpu`."""

import pytest
import torch

needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU (missing hardware): run `make test-gpu` on a GPU machine")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "tests/gpu" in str(item.fspath):
            item.add_marker(needs_gpu)
