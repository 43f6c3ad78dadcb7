"""The machine and the TP layout the cost model runs on.

Every number is a plain field so a user can override it (CLI: `--hw key=value`).
Defaults: one H200 per GPU slot, 8 per node on NVLink 4 (NVSwitch), one
400 Gb/s InfiniBand NIC per GPU. Bandwidths are *achievable* ones, not the
datasheet's: a copy-engine put reaches ~80% of NVLink's 450 GB/s per direction,
an NDR NIC ~45 of its 50 GB/s.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..config import BACKENDS

_POSITIVE = ("sms", "gemm_efficiency", "gemm_k_half")
MODES = ("graph", "eager")  # CUDA-graph replay, or launched from Python every call


@dataclass(frozen=True)
class Hardware:
    """One GPU and its links. Times in microseconds, bandwidths in GB/s (1e9 B/s)."""

    name: str = "H200"
    sms: int = 132
    peak_tflops: float = 989.0  # bf16 / fp16 dense
    fp8_peak_tflops: float = 1979.0  # FP8 dense (torch._scaled_mm)
    tf32_peak_tflops: float = 494.0  # fp32 GEMMs, which run TF32 dense
    gemm_efficiency: float = 0.82  # best fraction of peak a large cuBLAS GEMM sustains
    gemm_k_half: float = 256.0  # K at which the mainloop reaches half its efficiency gain
    kernel_us: float = 2.0  # per GEMM kernel on the device: launch gap, prologue, tail
    hbm_gbs: float = 4000.0  # achievable HBM bandwidth (elementwise adds)
    nvlink_gbs: float = 360.0  # per direction per GPU, copy-engine puts
    nvlink_latency_us: float = 3.0
    sm_copy_gbs: float = 25.0  # NVLink bandwidth one SM drives in an SM-based copy kernel
    ib_gbs: float = 45.0  # per GPU (one NIC each), per direction
    ib_latency_us: float = 5.0
    nccl_latency_us: float = 10.0  # fixed cost of one NCCL collective
    nccl_sms: int = 16  # SMs an NCCL kernel occupies (torch_p2p: num_sm has no effect)
    nccl_inter_gbs: float | None = None  # bus bandwidth across nodes; None: min(NVLink, IB x GPUs/node)
    eager_step_us: float = 50.0  # host time per schedule step launched from Python
    eager_comm_us: float = 10.0  # host time to launch one transfer or collective
    eager_kernel_us: float = 10.0  # host time to launch one memory-bound kernel (FP8 work)

    def peak_for(self, dtype: torch.dtype) -> float:
        """Dense TFLOP/s of a GEMM whose operands are `dtype` (FP8: one byte each)."""
        if dtype.itemsize == 1:
            return self.fp8_peak_tflops
        return self.tf32_peak_tflops if dtype == torch.float32 else self.peak_tflops

    def replace(self, **changes: Any) -> "Hardware":
        return dataclasses.replace(self, **changes)

    @classmethod
    def parse_overrides(cls, items: list[str]) -> dict[str, Any]:
        """['ib_gbs=25', 'sms=114'] -> typed field values (ValueError on an unknown key)."""
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        out: dict[str, Any] = {}
        for item in items:
            key, sep, value = item.partition("=")
            if not sep or key not in types:
                raise ValueError(f"--hw {item!r}: expected key=value with key one of "
                                 f"{', '.join(types)}")
            out[key] = cls._read(item, key, str(types[key]), value)
        return out

    @staticmethod
    def _read(item: str, key: str, kind: str, value: str) -> Any:
        """One --hw value, typed and range-checked (ValueError naming the flag)."""
        if kind == "str":
            return value
        if kind != "int" and value.lower() == "none" and "None" in kind:
            return None
        lo = 1 if key in _POSITIVE or key.endswith(("_gbs", "tflops")) else 0
        what = "an integer" if kind == "int" else "a finite number"
        allowed = f"{what} {'> 0' if lo else '>= 0'}" + (" and <= 1" if key == "gemm_efficiency" else "")
        try:
            v = int(value) if kind == "int" else float(value)
        except ValueError:
            v = None
        if v is None or not math.isfinite(v) or v < 0 or (lo and v <= 0) or (
                key == "gemm_efficiency" and v > 1):
            raise ValueError(f"--hw {item!r}: {key} must be {allowed}"
                             + (" (or none)" if "None" in kind else ""))
        return v


@dataclass(frozen=True)
class Layout:
    """The TP group: `tp` ranks, `gpus_per_node` of them per node, ranks node-major
    (TP rank r lives on node r // local). mode: how the schedule is launched;
    backend: which transport moves intra-node chunks (inter-node ones go over IB)."""

    tp: int
    gpus_per_node: int = 8
    mode: str = "graph"
    backend: str = "symm"

    def __post_init__(self) -> None:
        if self.tp < 1 or self.gpus_per_node < 1:
            raise ValueError(f"tp ({self.tp}) and gpus_per_node ({self.gpus_per_node}) must be >= 1")
        if self.tp > self.gpus_per_node and self.tp % self.gpus_per_node:
            raise ValueError(f"a TP group of {self.tp} spanning nodes of {self.gpus_per_node} GPUs "
                             "must fill whole nodes")
        if self.mode not in MODES:
            raise ValueError(f"mode {self.mode!r}: one of {', '.join(MODES)}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend {self.backend!r}: one of {', '.join(BACKENDS)}")

    @property
    def local(self) -> int:
        """TP ranks per node."""
        return min(self.tp, self.gpus_per_node)

    @property
    def nodes(self) -> int:
        return self.tp // self.local

    def node(self, rank: int) -> int:
        return rank // self.local

    def describe(self) -> str:
        where = "1 node" if self.nodes == 1 else f"{self.nodes} nodes x {self.local}"
        return f"TP={self.tp} ({where}), {self.mode}, {self.backend}"
