"""The schedule cases the FP8 schedule tests run (per-tensor: test_fp8_schedules.py;
row-wise: test_fp8_rowwise.py): TP sizes, the test tensor sizes, every all-gather and
reduce-scatter variant, and the emulated nodes of the hierarchical ones."""

TP_SIZES = (2, 4)
ROWS, K, N = 16, 32, 48
AG = {"ring": dict(method="ring_exchange"), "ring_aggregate": dict(method="ring_exchange",
                                                                   aggregate=True),
      "bulk": dict(method="bulk"), "hierarchical": dict(method="ring_exchange", nodes=True)}
RS = {"pipeline2": ("pipeline", 2, True), "pipeline1": ("pipeline", 1, True),
      "ring": ("ring_exchange", 1, True), "bulk": ("bulk", 1, True),
      "hierarchical": ("ring_exchange", 1, "nodes"), "allreduce_pipeline2": ("pipeline", 2, False),
      "allreduce_bulk": ("bulk", 1, False)}


def _nodes(world: int) -> list[list[int]]:
    """Two emulated nodes of half the ranks each (one node at TP=1)."""
    half = max(world // 2, 1)
    return [list(range(i, i + half)) for i in range(0, world, half)]
