"""The transport contract and the GEMM seam on a modelled clock: the cost model runs
the real schedules of `overlap` on every rank of the TP group, on meta tensors
(shapes, no data), and records what each rank issues, in program order, for
`play` to time on a `Sim`:

- ("gemm", rows, k, n, out): a GEMM through the `gemm=` seam (`modelled_gemm`);
- ("add", bytes, out) / ("copy", dst, src) / ("reduce", bytes read and written, out,
  inp): the schedule's own elementwise ops (a reduce-scatter's sum of its partials,
  flat or hierarchical), seen by the meta tensors they run on;
- ("exchange", handle, sends, recvs): sends = ((peer, bytes, src), ...),
  recvs = ((peer, dst), ...);
- ("collective", handle, kind, block bytes, input, output);

Sizes are bytes of the tensors as the schedule holds them, so a pass moves what its
tensors' dtypes carry (FP8: one byte per element, row-wise scale tails included).
- ("wait", handle).

Tensors are named by region: (storage number on that rank, first byte, end byte),
which is what `play` tracks readiness by. A schedule's elementwise work is in
place or into `out=` (it allocates nothing per call, for CUDA graphs); any other
op that writes is an error naming it: the model must not give new work no time.
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Callable, Optional, Sequence

import torch

from ..comm import stats, trace
from ..comm.transport import Handle, Peer, SendRecv, Transport
from ..overlap.gemm import Gemm

Region = tuple[int, int, int]
Event = tuple
_IN_PLACE = frozenset(f"__i{op}__" for op in (
    "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift",
    "matmul")) | {"__setitem__"}


class _Rank:
    """What one rank's schedule issued, and the tensors it touched (kept alive while it
    runs, so no storage is reused under another region's name)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._storages: dict[int, int] = {}
        self._alive: list[torch.Tensor] = []
        self._handles = 0

    def region(self, t: torch.Tensor) -> Region:
        with torch._C.DisableTorchFunctionSubclass():
            key = t.untyped_storage()._cdata
            if key not in self._storages:
                self._storages[key] = len(self._storages)
                self._alive.append(t)
            size = t.element_size()
            span = 1 + sum((d - 1) * s for d, s in zip(t.shape, t.stride())) if t.numel() else 0
            first = t.storage_offset() * size
        return self._storages[key], first, first + span * size

    def handle(self) -> int:
        self._handles += 1
        return self._handles


_recording: ContextVar[Optional[_Rank]] = ContextVar("megatron_overlap_simulate", default=None)


class _Meta(torch.Tensor):
    """A meta tensor whose in-place adds and copies are events of the rank that runs
    (views and allocations of it are _Meta too). Nothing is computed: no data."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        rec = _recording.get()
        if rec is not None:
            if name in ("add_", "__iadd__") or (name == "add" and "out" in kwargs):
                out = kwargs.get("out", args[0])
                rec.events.append(("add", nbytes(out), rec.region(out)))
                return out
            if name == "sum" and "out" in kwargs:
                out, inp = kwargs["out"], args[0]
                rec.events.append(("reduce", nbytes(inp) + nbytes(out), rec.region(out),
                                   rec.region(inp)))
                return out
            if name == "copy_":
                rec.events.append(("copy", rec.region(args[0]), rec.region(args[1])))
                return args[0]
            if "out" in kwargs or name in _IN_PLACE or (name.endswith("_")
                                                        and not name.endswith("__")):
                raise NotImplementedError(
                    f"megatron_overlap.simulate: the schedule ran {name}, which the cost model "
                    f"has no time for; give it one in simulate/transport.py and simulate/play.py")
        return super().__torch_function__(func, types, args, kwargs)


def meta_empty(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A tensor of `shape` for a modelled run: no memory, its writes recorded."""
    return torch.empty(*shape, dtype=dtype, device="meta").as_subclass(_Meta)


class _Issued(Handle):
    """A modelled transfer: waiting on it is an event of its rank."""

    def __init__(self, rank: _Rank, handle: int):
        self._rank, self._handle = rank, handle

    def wait(self) -> None:
        self._rank.events.append(("wait", self._handle))


class ModelledTransport(Transport):
    """One rank's end of the modelled TP group: moves nothing, records what it is asked."""

    name = "modelled"

    def __init__(self, rank: int, world_size: int, record: _Rank):
        super().__init__(rank, world_size)
        self.record = record

    def workspace(self, shape: Sequence[int], dtype: torch.dtype, device=None) -> torch.Tensor:
        return meta_empty(*shape, dtype=dtype)

    def _issue(self, event: Callable[[int], Event]) -> Handle:
        h = self.record.handle()
        self.record.events.append(event(h))
        return _Issued(self.record, h)

    def _start_exchange(self, sends: Sequence[tuple[torch.Tensor, Peer, torch.Tensor]],
                        recvs: Sequence[SendRecv], op: str, chunk: int) -> Handle:
        r = self.record
        out = tuple((p, nbytes(t), r.region(t)) for t, p, _ in sends)
        into = tuple((p, r.region(t)) for t, p in recvs)
        return self._issue(lambda h: ("exchange", h, out, into))

    def _collective(self, kind: str, block: int, inp: torch.Tensor, out: torch.Tensor) -> Handle:
        r = self.record
        return self._issue(lambda h: ("collective", h, kind, block, r.region(inp), r.region(out)))

    def _start_all_gather(self, out, inp, op, chunk) -> Handle:
        return self._collective("all_gather", nbytes(inp), inp, out)

    def _start_reduce_scatter(self, out, inp, op, chunk) -> Handle:
        return self._collective("reduce_scatter", nbytes(out), inp, out)

    def _start_all_reduce(self, tensor, op, chunk) -> Handle:
        return self._collective("all_reduce", nbytes(tensor) // self.world_size, tensor, tensor)


class _ModelledGemm:
    """The `gemm=` seam on the modelled clock: records the chunk's shape (its time is the
    cost model's per-chunk GEMM time, applied by `play`); traced like `overlap.matmul`.
    `out_dtype`: what it outputs (an FP8 GEMM's: the parameters' dtype); `tail`: bytes
    after each row of `a` that are not multiplied (a row-wise scale, as `RowScaledGemm`)."""

    def __init__(self, record: _Rank, out_dtype: Optional[torch.dtype], tail: int) -> None:
        self.record, self.out_dtype, self.tail = record, out_dtype, tail

    def __call__(self, a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None, *,
                 op: str, chunk: int = 0) -> torch.Tensor:
        trace.record("gemm", op, chunk)
        rows = a.shape[0] * a.shape[1] if a.dim() == 3 else a.shape[0]
        if out is None:
            out = meta_empty(*a.shape[:-1], b.shape[-1], dtype=self.out_dtype or a.dtype)
        self.record.events.append(("gemm", rows, a.shape[-1] - self.tail, b.shape[-1],
                                   self.record.region(out)))
        return out


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def modelled_gemm(record: _Rank, out_dtype: Optional[torch.dtype] = None, tail: int = 0) -> Gemm:
    """A modelled GEMM seam for `record`'s rank (`_ModelledGemm`)."""
    return _ModelledGemm(record, out_dtype, tail)


def record(body: Callable[[Transport, Callable], None], world: int,
           out_dtype: Optional[torch.dtype] = None, tail: int = 0) -> list[list[Event]]:
    """Run `body(transport, gemm)` (one rank's schedule) for every rank of a group of
    `world`, the GEMM `modelled_gemm(out_dtype, tail)`; returns each rank's events.
    Nothing reaches the per-op stats."""
    out = []
    with stats.set_aside():
        for rank in range(world):
            rec = _Rank()
            token = _recording.set(rec)
            try:
                body(ModelledTransport(rank, world, rec), modelled_gemm(rec, out_dtype, tail))
            finally:
                _recording.reset(token)
            out.append(rec.events)
    return out
