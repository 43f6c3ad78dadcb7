"""The runner of the FP8 layers' compiled kernels (`overlap.fp8._call_compiled`, what
`_run_compiled` does past its CUDA check) on CPU, under dynamo with its `eager` backend
(the same frames, guards and variants as inductor's on a GPU, without code generation):
each kernel key compiles in a frame of its own, so one key's variants never count toward
another's recompile limit; inside a CUDA-graph capture nothing compiles (the call runs
eagerly, the compiled key kept); a key that fails to compile runs eagerly from then on,
said once (tests/gpu/test_fp8_cast_gpu.py holds the GPU's kernels)."""

import functools
import logging

import pytest
import torch

from megatron_overlap.overlap import fp8 as f


@pytest.fixture
def eager_dynamo(monkeypatch):
    torch._dynamo.reset()
    monkeypatch.setattr(f, "_BACKEND", "eager")
    monkeypatch.setattr(f, "_compiled", {})
    yield
    torch._dynamo.reset()


def _double(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(x * 2)


def _limit_hits(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "recompile_limit" in r.getMessage()]


@pytest.mark.parametrize("own_frames", [True, False])
def test_each_key_s_variants_count_toward_its_own_limit(eager_dynamo, caplog, own_frames):
    """Two keys of one function, two variants each (specialized lengths), under a limit of
    3: in frames of their own, no key reaches it; as one key (what one shared frame did),
    dynamo reports its limit hit (so the check can see it), and the calls past it still
    compute right (eagerly)."""
    fn = functools.partial(_double)
    with torch._dynamo.config.patch(recompile_limit=3), caplog.at_level(logging.WARNING):
        for key, sizes in (("a", (1, 2)), ("b", (3, 4))):
            for n in sizes:
                x = torch.arange(n, dtype=torch.float32)
                out = torch.empty_like(x)
                assert f._call_compiled((key if own_frames else "a",), fn, (x, out), False, False)
                assert torch.equal(out, x * 2), (key, n)
    assert bool(_limit_hits(caplog)) != own_frames, _limit_hits(caplog)


def test_inside_a_capture_nothing_compiles(eager_dynamo):
    """A key not compiled yet is not compiled inside a capture, and one whose guards ask
    for a new variant is refused there (the caller runs it eagerly, captured so): False
    both times, and the compiled key is kept for the calls outside."""
    fn = functools.partial(_double)
    x = torch.ones(4)
    assert not f._call_compiled(("new",), fn, (x, torch.empty_like(x)), False, True)
    assert ("new",) not in f._compiled
    assert f._call_compiled(("k",), fn, (x, torch.empty_like(x)), False, False)
    y = torch.ones(5)  # another length: a recompile, refused under the capture's stance
    assert not f._call_compiled(("k",), fn, (y, torch.empty_like(y)), False, True)
    assert f._compiled[("k",)] is not None
    out = torch.empty_like(y)
    assert f._call_compiled(("k",), fn, (y, out), False, False) and torch.equal(out, y * 2)


def test_a_key_that_fails_to_compile_runs_eagerly_from_then_on(eager_dynamo, caplog):
    def broken(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("no compiler here")

    with caplog.at_level(logging.WARNING, logger="megatron_overlap"):
        x = torch.ones(2)
        assert not f._call_compiled(("cast",), broken, (x, torch.empty_like(x)), True, False)
        assert not f._call_compiled(("cast",), broken, (x, torch.empty_like(x)), True, False)
    assert f._compiled[("cast",)] is None
    said = [r.getMessage() for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert len(said) == 1 and "no compiler here" in said[0], said
