"""Measurement callables, one per kind of machine. Each takes a Trial (a layer
pass and one candidate setting) and returns {"time_ms": ..., ...}; the tuner
only ever picks by time_ms.

- ModelMeasure (CPU, or anywhere): the cost model alone. Nothing is measured.
- ComputeSideMeasure (one GPU): the pass's GEMM side timed on this GPU (the
  layer's pass on the null transport, and the monolithic GEMM in the pass's operand
  layout: fprop NT, dgrad NN, wgrad TN), the communication from the cost model.
- DistributedMeasure (several GPUs, one rank per GPU, the TP group spanning
  them): the real overlapped pass, timed on every rank. Its timer is a
  callable, so the same code runs on gloo CPU ranks in tests.

Both measuring ones time the layer's own pass functions (`tune.passes`), in the
precision of the trial's shape (`Shape.numerics`: FP8 passes through `fp8_trial_pass`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ..simulate import Calibration, GemmModel, Hardware, Layout, Trial, simulate_pass
from ..simulate.host import HostTime
from ..simulate.passes import PassResult


def job_of(trial: Trial) -> dict[str, Any]:
    """What a trial measures, as plain data (cache key, JSON, wandb)."""
    s = trial.spec.shape
    return {"pass": trial.name, "model": s.model, "m": s.m, "k": s.k, "n": s.n, "tp": s.tp,
            "gemm": list(trial.spec.gemm), "settings": trial.candidate.to_dict(),
            "comm_moved": trial.comm_moved, "precision": s.numerics.to_dict()}


def _result(r: PassResult, source: str) -> dict[str, Any]:
    return {"time_ms": r.overlapped_us / 1e3, "baseline_ms": r.baseline_us / 1e3,
            "compute_only_ms": r.compute_only_us / 1e3, "exposed_ms": r.exposed_us / 1e3,
            "hidden_fraction": r.hidden, "source": source,
            "host_ms": None if r.host_us is None else r.host_us / 1e3, "host_bound": r.host_bound,
            "gemm_dtype": r.gemm_dtype, "moved_bytes": r.moved_bytes}


def _machine(hw: Hardware, layout: Layout, host: HostTime | None = None) -> dict[str, Any]:
    """What the results depend on besides the trial (the cache key's machine part)."""
    out = {"hw": dataclasses.asdict(hw), "layout": dataclasses.asdict(layout)}
    return {**out, "host_time": host.source, "host_figures": host.fingerprint()} \
        if host is not None else out


class ModelMeasure:
    """The cost model only: predictions, not measurements."""

    mode = "model"

    def __init__(self, hw: Hardware, layout: Layout, calibration: Calibration | None = None) -> None:
        self.hw, self.layout = hw, layout
        self.gemm = GemmModel(hw, calibration)
        self.hardware = {"kind": "cost-model", **_machine(hw, layout, self.gemm.calibration.host),
                         "calibration": self.gemm.calibration.source or None,
                         "ring_rs": self.gemm.calibration.ring_rs}

    def __call__(self, trial: Trial) -> dict[str, Any]:
        c = trial.candidate
        r = simulate_pass(trial.spec, c.settings, self.hw, self.layout, self.gemm,
                          trial.comm_moved)
        return _result(r, "model")


def _chunking(trial: Trial, tp: int) -> tuple[str, str, int] | None:
    """(op, kind, chunks) of the trial's chunked GEMM schedule, None when it runs one GEMM."""
    s = trial.candidate.settings
    if trial.comm_moved or trial.spec.comm == "none" or tp == 1 or s.method in ("bulk", "external"):
        return None
    if s.method == "pipeline":
        return "rs", "rs_pipeline", s.splits(tp)
    return ("rs", "rs_ring", tp) if s.is_reduce_scatter else ("ag", "ag_ring", tp)


class ComputeSideMeasure:
    """One GPU: GEMMs and chunked schedules timed here, fed to the cost model as its
    calibration; the communication is the model's.

    Each chunked trial is timed as the layer runs it with that candidate's settings
    (`passes.as_timed`: aggregate, gemm_streams, num_splits, priorities, ring order, ...
    applied) and the timing is kept under `passes.timed_key`, derived from those settings:
    two candidates share a timing only where their passes run the same thing on the null
    transport (e.g. num_sm, which holds nothing back there; the model applies the margin).
    The model then predicts each trial from its own timing alone. Monolithic GEMMs are
    timed once per shape and operand layout (the pass's `PassSpec.gemm_layout`: fprop NT,
    dgrad NN, wgrad TN; cuBLAS may pick another kernel per layout), and the model takes each
    pass's monolithic GEMM (its bulk / external compute side, the non-overlapped baseline,
    the reference of its chunked timing's ratio) in that pass's own layout.

    time_gemm(m, k, n, layout, dtype, fast_accum) and time_pass(fn, m, k, n, layout, dtype,
    fast_accum) -> measure_gemm / measure_pass's dicts (default: those, CUDA; `fast_accum`:
    the pass's FP8 GEMMs accumulate fast, `Precision.fast_accum`, and so does its whole
    GEMM); device: where the passes' tensors live. Tests inject CPU ones."""

    mode = "compute"

    def __init__(self, hw: Hardware, layout: Layout, *, reps: int = 20, dtype: Any = None,
                 host: HostTime | None = None, device: Any = "cuda",
                 time_gemm: Callable[..., dict[str, Any]] | None = None,
                 time_pass: Callable[..., dict[str, Any]] | None = None) -> None:
        import torch

        from ..overlap.streams import default_gemm_streams
        from .measure import device_name

        self.hw, self.layout, self.reps, self.device = hw, layout, reps, device
        self.dtype = dtype or torch.bfloat16
        self.calibration = Calibration(source=f"measured on this GPU ({device_name()})", host=host)
        self.calibrations: dict[Any, Calibration] = {}  # FP8 GEMMs', per operand dtype
        # timed_key -> its ratios, keyed (m, k, n, layout, kind, chunks)
        self.timed: dict[str, dict[tuple[int, int, int, str, str, int], dict[str, float]]] = {}
        self.time_gemm = time_gemm or self._time_gemm
        self.time_pass = time_pass or self._time_pass
        self.hardware = {"kind": "compute-side", "device": device_name(),
                         "torch": torch.__version__, "gemm_streams_default": default_gemm_streams(),
                         **_machine(hw, layout, host)}

    def _time_gemm(self, m: int, k: int, n: int, layout: str, dtype: Any,
                   fast_accum: bool = False) -> dict[str, Any]:
        from .measure import measure_gemm

        return measure_gemm(m, k, n, layout, reps=self.reps, dtype=dtype, out_dtype=self.dtype,
                            fast_accum=fast_accum)

    def _calibration(self, dtype: Any) -> Calibration:
        """The measurements of GEMMs in `dtype`: FP8 ones apart, the rest `calibration`."""
        if dtype.itemsize > 1:
            return self.calibration
        if dtype not in self.calibrations:
            self.calibrations[dtype] = Calibration(source=self.calibration.source,
                                                   host=self.calibration.host)
        return self.calibrations[dtype]

    def _time_pass(self, fn: Callable[[], Any], m: int, k: int, n: int, layout: str,
                   dtype: Any, fast_accum: bool = False) -> dict[str, Any]:
        from .measure import measure_pass

        return measure_pass(fn, m, k, n, layout, reps=self.reps, dtype=dtype,
                            out_dtype=self.dtype, fast_accum=fast_accum)

    def __call__(self, trial: Trial) -> dict[str, Any]:
        from ..comm import NullTransport
        from .passes import (as_timed, fast_accum_of, layout_nodes, precision_of, timed_key,
                             trial_pass)

        m, k, n = trial.spec.gemm
        ops = trial.spec.gemm_layout  # the pass's operand layout: its GEMMs are timed in it
        gdt = trial.spec.gemm_dtype  # the model's dtype for this pass's GEMMs
        dims, cal, tp = (m, k, n, ops), self._calibration(gdt), self.layout.tp
        measured: dict[str, Any] = {}
        timed_dtype = gdt if gdt.itemsize == 1 else self.dtype  # FP8, else this measure's
        precision = precision_of(trial.spec.shape.numerics)
        # FP8: the pass's GEMMs accumulate fast or not as the layer's would, its whole GEMM
        # too (a layout is one pass's, so its whole GEMM's timing is keyed as before)
        fast = fast_accum_of(trial)
        if dims not in cal.mono_samples:
            measured = self.time_gemm(m, k, n, ops, timed_dtype, fast_accum=fast)
            cal.add(dims, measured["mono_graph_ms"] * 1e3)
        chunking, key = _chunking(trial, tp), None
        if chunking:
            _, kind, chunks = chunking
            null = NullTransport(tp)
            key = timed_key(trial, null)
            if key not in self.timed:
                # the layer's own pass on the null transport, with this candidate's settings
                timed = as_timed(trial, null)
                run = trial_pass(timed, null, self.device, self.dtype, nodes=layout_nodes(timed),
                                 precision=precision)
                measured = self.time_pass(run.run, m, k, n, ops, timed_dtype, fast_accum=fast)
                own = Calibration()
                own.add(dims, measured["mono_graph_ms"] * 1e3, kind, chunks,
                        measured["sched_graph_ms"] * 1e3, measured["sched_ms"] * 1e3,
                        measured["host_us_sched"])
                self.timed[key] = own.ratios
                cal.add(dims, measured["mono_graph_ms"] * 1e3)
                cal.host_step_us += own.host_step_us
        # the model sees this trial's own chunked timing and no other candidate's
        mine = dataclasses.replace(cal, ratios=self.timed[key] if key is not None else {})
        c = trial.candidate
        r = simulate_pass(trial.spec, c.settings, self.hw, self.layout,
                          GemmModel(self.hw, mine, gdt), trial.comm_moved)
        return {**_result(r, "compute-side measured + modelled communication"),
                **{f"measured_{k}": v for k, v in measured.items()}}


Timer = Callable[[Callable[[], Any]], float]


class DistributedMeasure:
    """The real thing, on every rank of `group` at once (every rank must call it with the
    same trials in the same order). time_ms is the slowest rank's; the non-overlapped
    path and the compute-only floor (null transport) are timed beside it.

    timer(fn) -> ms per call: CUDA events on GPUs (default), anything on CPU."""

    mode = "real"

    def __init__(self, group: Any = None, backend: str = "auto", *, timer: Timer | None = None,
                 dtype: Any = None, device: Any = None, reps: int = 20) -> None:
        import torch
        import torch.distributed as dist

        from .. import comm

        self.group = group or dist.group.WORLD
        self.device = device or (torch.device("cuda", torch.cuda.current_device())
                                 if torch.cuda.is_available() else torch.device("cpu"))
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.transport = comm.transport_for(self.group, backend, self.device)
        if timer is None:
            from .measure import time_ms

            timer = lambda fn: time_ms(fn, reps)  # noqa: E731
        self.timer = timer
        from ..overlap.streams import default_gemm_streams

        self.hardware = {"kind": "distributed", "transport": self.transport.name,
                         "world": dist.get_world_size(self.group),
                         "gemm_streams_default": default_gemm_streams(),  # what gemm_streams 0 runs
                         "device": torch.cuda.get_device_name() if self.device.type == "cuda"
                         else "cpu"}

    def _slowest(self, ms: float) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([ms], dtype=torch.float64, device=self.device if
                         dist.get_backend(self.group) == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def __call__(self, trial: Trial) -> dict[str, Any]:
        from ..comm import NullTransport
        from ..comm.topology import topology
        from ..layers.plan import ring_order
        from .passes import precision_of, trial_pass

        tp, s = self.transport, trial.candidate.settings
        precision = precision_of(trial.spec.shape.numerics)
        order = ring_order(s, True, topology(self.group, self.device))  # as the layer picks it
        nodes = order.nodes if order is not None else None
        time = lambda t, **kw: self._slowest(self.timer(  # noqa: E731
            trial_pass(trial, t, self.device, self.dtype, precision=precision, **kw).run))
        over = time(tp, nodes=nodes)
        base = time(tp, overlap=False)
        floor = time(NullTransport(tp.world_size, tp.rank, like=tp), nodes=nodes)
        room = base - floor
        return {"time_ms": over, "baseline_ms": base, "compute_only_ms": floor,
                "exposed_ms": over - floor, "hidden_fraction": (base - over) / room if room > 0
                else None, "ring_order": order.label if order is not None else "-",
                "source": f"measured ({tp.name})"}
