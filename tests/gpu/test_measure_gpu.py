"""The benchmarks' interleaved timing (`tune.measure.interleaved_samples`) attributes each
call's GPU time to its own arm, queued back to back (eager steps) or synced per call (graph
replays): arms that keep the GPU busy 1x, 2x and 3x as long read in that ratio."""

import pytest
import torch

from megatron_overlap.tune.measure import interleaved_samples

CYCLES = 2_000_000  # torch.cuda._sleep's spin, ~1 ms on a Hopper GPU


@pytest.mark.parametrize("queued", [True, False])
def test_interleaved_calls_are_timed_per_arm(queued):
    fns = {f"x{k}": (lambda k=k: torch.cuda._sleep(k * CYCLES)) for k in (1, 2, 3)}
    got = interleaved_samples(fns, reps=6, warmup=1, queued=queued)
    assert list(got) == list(fns)
    for name, (dev, host) in got.items():
        assert len(dev) == len(host) == 6  # 3 arms: 2 calls of each per cycle, 3 cycles
    med = {n: sorted(d)[len(d) // 2] for n, (d, _) in got.items()}
    assert med["x2"] / med["x1"] == pytest.approx(2, rel=0.1), med
    assert med["x3"] / med["x1"] == pytest.approx(3, rel=0.1), med
    if queued:  # the host only issued them: far less than the GPU's time
        assert max(max(h) for _, h in got.values()) < 1e3 * med["x1"] / 2
