"""What a result was measured on, stored with every benchmark result: a figure
without its machine, versions and date cannot be compared with anything."""

from __future__ import annotations

import os
import platform
import sys
import time

import torch

from ..overlap.streams import default_gemm_streams
from .launch import SAFE_ENV, SHARED_ENV, Layout


def _nccl() -> str | None:
    try:
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # no NCCL in this build
        return None


def machine_info(layout: Layout, device: torch.device) -> dict[str, object]:
    info: dict[str, object] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "mode": layout.mode,
        "ranks": layout.world,
        "dist_backend": layout.dist_backend,
        "functional_only": layout.functional_only,
        "note": layout.note,
        # the transports' safety settings and our own knobs (MEGATRON_OVERLAP_*: a run with
        # MEGATRON_OVERLAP_GEMM_STREAMS=1 is not the run with the default three)
        "env": {k: v for k, v in sorted(os.environ.items())
                if k in SAFE_ENV or k in SHARED_ENV or k.startswith("MEGATRON_OVERLAP_")},
        # what a layer's gemm_streams 0 ran on (the default changed from 1 to 3)
        "gemm_streams_default": default_gemm_streams(),
    }
    try:
        import megatron.core

        info["megatron_core"] = getattr(megatron.core, "__version__", "?")
    except ImportError:
        pass
    if device.type == "cuda":
        info.update(gpu_name=torch.cuda.get_device_name(device), gpu_count=torch.cuda.device_count(),
                    cuda=torch.version.cuda, nccl=_nccl())
    else:
        info.update(gpu_name=None, gpu_count=0, cpu=platform.processor() or platform.machine())
    return info
