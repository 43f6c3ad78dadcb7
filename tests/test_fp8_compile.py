"""The runner of the FP8 layers' compiled kernels (`overlap.fp8._call_compiled`, what
`_run_compiled` does past its CUDA check) on CPU, under dynamo with its `eager` backend
(the same frames, guards and variants as inductor's on a GPU, without code generation):
each kernel key in a frame of its own, and a key whose variants reach dynamo's recompile
limit said once in the log, where dynamo alone would run every further variant eagerly
without a word (tests/gpu/test_fp8_cast_gpu.py holds the GPU's kernels)."""

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
    monkeypatch.setattr(f, "_frames", {})
    monkeypatch.setattr(f, "_full", set())
    yield
    torch._dynamo.reset()


def _double(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    return out.copy_(x * 2)


def test_a_key_at_dynamo_s_recompile_limit_is_said_once(eager_dynamo, caplog):
    fn = functools.partial(_double)
    with torch._dynamo.config.patch(recompile_limit=3), \
            caplog.at_level(logging.WARNING, logger="megatron_overlap"):
        for n in range(1, 7):  # specialized: every length another variant
            x = torch.arange(n, dtype=torch.float32)
            out = torch.empty_like(x)
            assert f._call_compiled(("probe", n > 0), fn, (x, out), False, False)
            assert torch.equal(out, x * 2), n  # past the limit too: dynamo runs it eagerly
    said = [r.getMessage() for r in caplog.records if "recompile limit" in r.getMessage()]
    assert len(said) == 1, said
    assert "fp8_probe_True has compiled 3 variants" in said[0], said


def test_keys_compile_in_frames_of_their_own(eager_dynamo, caplog):
    """Two keys of one function, each below the limit: no warning, though together they
    compile more variants than the limit (one shared frame would reach it)."""
    fn = functools.partial(_double)
    with torch._dynamo.config.patch(recompile_limit=3), \
            caplog.at_level(logging.WARNING, logger="megatron_overlap"):
        for key, sizes in (("a", (1, 2)), ("b", (3, 4))):
            for n in sizes:
                x = torch.ones(n)
                assert f._call_compiled((key,), fn, (x, torch.empty_like(x)), False, False)
    assert f._frames[("a",)] is not f._frames[("b",)]
    assert not [r for r in caplog.records if "recompile limit" in r.getMessage()]


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
