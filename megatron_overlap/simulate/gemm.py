"""GEMM device time: measured where the calibration has the shape in the operand
layout asked for (NT, NN, TN: `shapes.GEMM_LAYOUTS`; cuBLAS may pick another kernel
per layout), a roofline with wave quantization otherwise (the roofline ignores the layout).

Why wave quantization: an overlapped schedule cuts one GEMM into row chunks,
and a chunk's grid of output tiles rarely fills the SMs in whole waves; the
last, partial wave costs a full wave's time. cuBLAS softens this with other
tile shapes and split-K, so the roofline takes the best of a few tile shapes
(smaller ones slightly less efficient) and splits K when the grid underfills
the chip. Measured chunked/monolithic ratios override all of it.

Each GemmModel is of one operand dtype (`dtype`: its calibration was measured in it; the
roofline takes that dtype's peak and bytes). `for_dtype` gives the model of another:
the roofline at that dtype's peak, with the efficiency fitted to this one's measurements.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import torch

from .calibration import Calibration
from .hardware import Hardware

# (tile M, tile N, relative mainloop efficiency)
TILES = ((128, 256, 1.0), (256, 128, 1.0), (128, 128, 0.92), (64, 128, 0.8))
MIN_SPLIT_K_DEPTH = 512


def roofline_us(hw: Hardware, m: int, k: int, n: int, sms: int | None = None,
                dtype: torch.dtype = torch.bfloat16) -> float:
    """Best-tile roofline time of one [m,k]x[k,n] GEMM of `dtype` operands on `sms` SMs
    (default: all); an FP8 GEMM's output is taken as bf16."""
    sms = hw.sms if sms is None else sms
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    flops, peak = 2.0 * m * k * n, hw.peak_for(dtype) * 1e6 * sms / hw.sms  # flop per us
    size = dtype.itemsize
    mem_us = ((m * k + k * n) * size + m * n * max(size, 2)) / (hw.hbm_gbs * 1e3)
    best = math.inf
    for tm, tn, tile_eff in TILES:
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        split = 1
        if tiles < sms:  # split-K fills an underfilled chip
            split = max(1, min(sms // tiles, k // MIN_SPLIT_K_DEPTH))
        units = tiles * split
        wave_eff = units / (math.ceil(units / sms) * sms)
        depth = k / split
        eff = hw.gemm_efficiency * tile_eff * wave_eff * depth / (depth + hw.gemm_k_half)
        best = min(best, max(flops / (peak * eff), mem_us))
    return best + hw.kernel_us


def fit_efficiency(hw: Hardware, cal: Calibration, dtype: torch.dtype = torch.bfloat16) -> float:
    """gemm_efficiency that makes the roofline match the measured monolithic GEMMs
    (of `dtype`; median over shapes); the hardware's own value without measurements."""
    if not cal.mono:
        return hw.gemm_efficiency
    unit = hw.replace(gemm_efficiency=1.0, kernel_us=0.0)
    return statistics.median(roofline_us(unit, *d[:3], dtype=dtype) / max(t - hw.kernel_us, 1e-9)
                             for d, t in cal.mono.items())


@dataclass
class GemmModel:
    """GEMM times for the schedules. `calibration` may be empty (pure roofline). Each
    time is of an [m, k] x [k, n] GEMM with operands in `layout` (a pass's
    `PassSpec.gemm_layout`): measured times are looked up by (m, k, n, layout), never
    taken from another layout's GEMM of the same size. `dtype`: the operands' (and the
    calibration's)."""

    hw: Hardware
    calibration: Calibration | None = None
    dtype: torch.dtype = torch.bfloat16
    _others: dict[torch.dtype, "GemmModel"] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.calibration = self.calibration or Calibration()
        self._mono = self.calibration.mono
        self.fitted = self.hw.replace(
            gemm_efficiency=fit_efficiency(self.hw, self.calibration, self.dtype))

    def for_dtype(self, dtype: torch.dtype) -> "GemmModel":
        """The model of `dtype` GEMMs: this one, or (another dtype: nothing measured in it)
        the roofline at that dtype's peak with this model's fitted efficiency; the
        calibration's host figures kept."""
        if dtype == self.dtype:
            return self
        if dtype not in self._others:
            cal = self.calibration
            host = Calibration(host_step_us=list(cal.host_step_us), host=cal.host,
                               ring_rs=cal.ring_rs)
            self._others[dtype] = GemmModel(self.fitted, host, dtype)
        return self._others[dtype]

    def _roof(self, m: int, k: int, n: int, sms: int | None = None) -> float:
        return roofline_us(self.fitted, m, k, n, sms, self.dtype)

    def _sm_factor(self, m: int, k: int, n: int, sms: int | None) -> float:
        if sms is None or sms >= self.hw.sms:
            return 1.0
        return self._roof(m, k, n, sms) / self._roof(m, k, n)

    def mono_us(self, m: int, k: int, n: int, layout: str, sms: int | None = None) -> float:
        """One GEMM of the whole shape in `layout`: measured when calibrated, else the
        fitted roofline."""
        measured = self._mono.get((m, k, n, layout))
        base = measured if measured is not None else self._roof(m, k, n)
        return base * self._sm_factor(m, k, n, sms)

    def measured_chunks(self, m: int, k: int, n: int, layout: str, chunks: int,
                        kind: str | None, mode: str) -> bool:
        """Whether the calibration timed this chunked schedule in `mode`."""
        return kind is not None and self.calibration.chunked_us(
            (m, k, n, layout), kind, chunks, mode) is not None

    def chunk_us(self, m: int, k: int, n: int, layout: str, chunks: int,
                 kind: str | None = None, sms: int | None = None, extra_us: float = 0.0,
                 mode: str = "graph", rows: int | None = None) -> float:
        """One GEMM of a schedule of `chunks` row chunks, of `rows` rows (default m /
        chunks: one chunk; an aggregate ring's pairs are two) of [m, k] x [k, n]. `kind`
        names the measured schedule (ag_ring, rs_ring, rs_pipeline) whose time, in launch
        `mode`, applies, shared by rows; `extra_us`: device time that schedule's
        measurement holds besides its GEMMs (a ring reduce-scatter's reduction), taken out
        before sharing."""
        rows, dims = m // chunks if rows is None else rows, (m, k, n, layout)
        if chunks == 1:
            return self.mono_us(m, k, n, layout, sms)
        measured = self.calibration.chunked_us(dims, kind, chunks, mode) if kind else None
        if measured is None and kind and mode == "eager":  # fall back to the graphed timing
            measured = self.calibration.chunked_us(dims, kind, chunks, "graph")
        if measured is not None:
            base = max(measured - extra_us, 0.0) * rows / m
        elif dims in self._mono:  # measured whole, roofline ratio for the cut
            base = self._mono[dims] * self._roof(rows, k, n) / self._roof(m, k, n)
        else:
            base = self._roof(rows, k, n)
        return base * self._sm_factor(rows, k, n, sms)

    def ring_rs_extra_us(self, tp: int, block_bytes: float) -> float:
        """What a measured ring reduce-scatter's time holds besides its chunk GEMMs, as
        its calibration measured the schedule (`Calibration.ring_rs`): the one sum of the
        tp partials of a block, or, measured before that, tp - 1 running-sum adds."""
        if self.calibration.ring_rs == "adds":
            return (tp - 1) * self.mem_us(3 * block_bytes)
        return self.mem_us((tp + 1) * block_bytes)

    def mem_us(self, moved: float) -> float:
        """A memory-bound kernel that reads and writes `moved` bytes in all (a ring
        reduce-scatter's sum of the world partials: world reads and a write; the running-sum
        ring's `acc += incoming` measured before it: two reads and a write)."""
        return moved / (self.hw.hbm_gbs * 1e3) + self.hw.kernel_us

    def source(self, m: int, k: int, n: int, layout: str) -> str:
        return "measured" if (m, k, n, layout) in self._mono else "roofline"
