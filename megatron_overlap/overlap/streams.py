"""Where a schedule's chunk GEMMs run on a GPU (nothing changes on CPU).

- More than one stream: chunk i runs on stream i % n, so the last, partly
  filled wave of one chunk's GEMM runs beside the first wave of the next
  (wave quantization: a chunk rarely fills all SMs evenly).
- `priority`: the layer's `gemm_priority` (CUDA: lower is more urgent).
- `sm_margin`: with `set_sm_margin`, cuBLAS is held `num_sm` SMs short while the
  schedule runs, so an SM-based communication kernel is never starved.
The streams join back into the caller's stream when the schedule ends.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

import torch

_cache: dict[tuple[int, int, int], torch.cuda.Stream] = {}
_NOTHING = contextlib.nullcontext()


_default: int | None = None  # install(gemm_streams=...)


def default_gemm_streams() -> int:
    """Streams for chunk GEMMs of a layer whose `gemm_streams` key is 0: install()'s
    gemm_streams, else MEGATRON_OVERLAP_GEMM_STREAMS (checked), else
    config.names.DEFAULT_GEMM_STREAMS (as Transformer Engine runs them)."""
    if _default is not None:
        return _default
    from ..config.env import gemm_streams

    return gemm_streams()


def check_count(n: int | None, who: str = "megatron_overlap") -> None:
    """A process-wide stream count (None: keep the environment's) or a ValueError from `who`."""
    from ..config.names import MAX_GEMM_STREAMS

    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_GEMM_STREAMS):
        raise ValueError(f"{who}: gemm_streams must be an int in 1..{MAX_GEMM_STREAMS} or None, "
                         f"not {n!r}")


def set_default_gemm_streams(n: int | None) -> int | None:
    """Override the environment's default (None restores it); returns the previous override."""
    global _default
    check_count(n)
    previous, _default = _default, n
    return previous


class ChunkStreams:
    def __init__(self, n: int | None = None, priority: int = 0, sm_margin: int = 0):
        self.n = max(1, default_gemm_streams() if n is None else n)
        self.priority, self.sm_margin = priority, sm_margin
        self._streams: list[torch.cuda.Stream] = []
        self._carved, self._previous = False, None

    def __enter__(self) -> "ChunkStreams":
        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return self
        main = torch.cuda.current_stream()
        if self.n > 1 or self.priority != 0:
            dev = torch.cuda.current_device()
            self._streams = [stream(dev, i, self.priority) for i in range(self.n)]
            for s in self._streams:
                s.wait_stream(main)
        if self.sm_margin and hasattr(torch._C, "_set_sm_carveout_experimental"):
            self._carved, self._previous = True, torch._C._get_sm_carveout_experimental()
            torch._C._set_sm_carveout_experimental(self.sm_margin)
        return self

    def __exit__(self, *exc) -> None:
        main = torch.cuda.current_stream() if self._streams else None
        for s in self._streams:
            main.wait_stream(s)
        self._streams = []
        if self._carved:
            torch._C._set_sm_carveout_experimental(self._previous)
            self._carved = False

    def margin_only(self) -> "ChunkStreams":
        """Its SM margin alone, for a pass whose one GEMM runs on the caller's stream (the
        backward's bulk overlaps): no side streams to fork and join."""
        return ChunkStreams(n=1, sm_margin=self.sm_margin)

    def chunk(self, i: int) -> contextlib.AbstractContextManager:
        """Run what follows (waits included) on chunk i's stream."""
        if not self._streams:
            return _NOTHING
        return torch.cuda.stream(self._streams[i % len(self._streams)])


def stream(device: int, i: int = 0, priority: int = 0) -> torch.cuda.Stream:
    """The process's chunk stream i of `priority` on `device`, made at the first call."""
    key = (device, i, priority)
    if key not in _cache:
        lo, hi = torch.cuda.Stream.priority_range()
        _cache[key] = torch.cuda.Stream(device=device, priority=min(max(priority, hi), lo))
    return _cache[key]


_capture = threading.local()  # .stream: the pass replay's capture stream while it captures


@contextlib.contextmanager
def capturing_on(s: torch.cuda.Stream) -> Iterator[None]:
    """The pass replay captures on `s` inside (`off_capture` keeps GEMMs off it)."""
    previous, _capture.stream = getattr(_capture, "stream", None), s
    try:
        yield
    finally:
        _capture.stream = previous


def off_capture() -> contextlib.AbstractContextManager:
    """Where the GEMM launched inside runs: the current stream, except the pass replay's
    capture stream, from which it forks onto chunk stream 0 and joins back at once (the
    same order as on the capture stream). cuBLAS keeps a workspace per thread and stream
    (32 MiB on Hopper): a GEMM captured on the capture stream took one into the pass
    graphs' pool for each thread that captures (the forward's, autograd's), where on
    chunk stream 0 it uses the one that thread's chunk GEMMs made
    (`overlap.replay._capture`). The GEMM seams (`overlap.gemm`, `overlap.fp8`) and the
    weight-gradient kernels call it."""
    s = getattr(_capture, "stream", None)
    if s is None or torch.cuda.current_stream(s.device) != s:
        return _NOTHING
    return _forked(s, stream(s.device.index, 0))


@contextlib.contextmanager
def _forked(main: torch.cuda.Stream, side: torch.cuda.Stream) -> Iterator[None]:
    side.wait_stream(main)
    with torch.cuda.stream(side):
        yield
    main.wait_stream(side)


def plain() -> ChunkStreams:
    """The caller's stream only (CPU, tests, or a layer without GPU settings)."""
    return ChunkStreams(n=1)
