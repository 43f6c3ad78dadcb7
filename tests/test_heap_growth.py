"""How the symmetric-heap transports grow their workspace (comm/heap.py), on CPU memory:
a pass that outgrows the heap keeps the workspaces it already has, a growth takes what
the pass needs (not the next power of two) where the backend frees (`symm`), the
outgrown allocations are released at the next pass (after its barrier, as `symm` calls
it), never once a capture not ours has run a pass, and the workspaces' generation never
repeats. The transfers, and the device memory given back, are the GPU suite's
(tests/gpu/test_symm.py)."""

import pytest
import torch

from helpers import dist
from megatron_overlap.comm.heap import MIN_GROWTH, grown_size

MIB = 1 << 20


@pytest.mark.parametrize("need", [1, 4096, MIB - 1, 3 * MIB, 7 * MIB + 5, 288 * MIB,
                                  (1 << 30) + 1, 17 * (1 << 30) // 3])
def test_grown_size(need):
    freeing = grown_size(need, True)
    assert need <= freeing < need + max(need / 8, MIN_GROWTH) + 1  # at most 1/8 (or 2 MiB) more
    assert freeing % MIN_GROWTH == 0
    keeping = grown_size(need, False)  # nvshmem: doubles, its kept ones sum below the newest
    assert keeping >= need and keeping & (keeping - 1) == 0 and keeping < 2 * need + 2


def _cpu_heap(frees: bool):
    """A HeapTransport whose allocations are CPU tensors: the allocation policy alone."""
    from megatron_overlap.comm.heap import Buffer, HeapTransport

    class CpuHeap(HeapTransport):
        name = "cpu_heap"
        frees_outgrown = frees

        capturing = False  # stands for a CUDA-graph capture in progress

        def __init__(self):
            super().__init__(torch.distributed.group.WORLD, torch.device("cpu"))
            self.allocated: list[int] = []
            self._bufs.append(Buffer(torch.zeros(MIB, dtype=torch.uint8)))

        def begin_pass(self, name="", comm_priority=0):
            super().begin_pass(name, comm_priority)
            self._release_outgrown()  # where symm calls it: after its pass barrier

        def _capturing(self):
            return self.capturing

        def _alloc(self, nbytes):
            self.allocated.append(nbytes)
            return Buffer(torch.zeros(nbytes, dtype=torch.uint8))

        def _start_exchange(self, *a):
            raise NotImplementedError

        _start_all_gather = _start_reduce_scatter = _start_all_reduce = _start_exchange

    return CpuHeap()


def _passes(rank, world, frees, capture=""):
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    tp = _cpu_heap(frees)
    seen = []
    if capture:  # a pass captured first: by our pass replay (it records its waits) or not ours
        tp.capturing, tp._watchdog.captured = True, ([] if capture == "ours" else None)
        tp.begin_pass("captured")
        tp.capturing, tp._watchdog.captured = False, None

    def run(blocks):
        """One pass carving `blocks` workspaces of 3 MiB, each filled with its index:
        every one still holds its own value at the pass's end (no workspace of the pass
        was carved over another's when the heap grew under it)."""
        tp.begin_pass("fc1_fprop")
        views = [tp.workspace((3 * MIB // 4,), torch.float32) for _ in range(blocks)]
        for i, v in enumerate(views):
            v.fill_(i)
        intact = all(bool((v == i).all()) for i, v in enumerate(views))
        seen.append({"held": tp.bytes_held, "generation": tp.generation, "intact": intact,
                     "allocated": list(tp.allocated), "high_water": tp.pass_bytes["fc1_fprop"]})

    for blocks in (2, 2, 3, 3, 1, 3):
        run(blocks)
    return seen


def test_a_growth_takes_what_the_pass_needs_and_gives_back_the_rest():
    seen = dist.run(_passes, 1, True, timeout=120)[0]
    assert all(s["intact"] for s in seen)
    # pass 1: 3 MiB outgrows the 1 MiB it started with (4 MiB taken), the next 3 MiB
    # outgrows that (6 MiB: the pass's 6, not 8); the pass keeps all three until it ends
    assert seen[0]["allocated"] == [4 * MIB, 6 * MIB] and seen[0]["held"] == 11 * MIB
    # pass 2 fits the newest; the outgrown ones were given back when it began
    assert seen[1]["held"] == 6 * MIB and seen[1]["allocated"] == seen[0]["allocated"]
    # pass 3 needs 9 MiB: 6 carried into the newest, then 10 MiB (9 rounded to 2 MiB)
    assert seen[2]["allocated"][-1] == 10 * MIB and seen[2]["held"] == 16 * MIB
    # from then on the heap holds 10 MiB for a pass of 9, shorter passes included
    assert [s["held"] for s in seen[3:]] == [10 * MIB] * 3
    assert [s["high_water"] for s in seen] == [6 * MIB] * 2 + [9 * MIB] * 4
    # a new allocation is a new generation (never repeated); giving one back is not
    assert [s["generation"] for s in seen] == [2, 2, 3, 3, 3, 3]


def test_a_heap_that_cannot_free_doubles_and_keeps():
    seen = dist.run(_passes, 1, False, timeout=120)[0]
    assert all(s["intact"] for s in seen)
    assert seen[-1]["allocated"] == [4 * MIB, 8 * MIB, 16 * MIB]
    assert seen[-1]["held"] == 29 * MIB and [s["generation"] for s in seen] == [2, 2, 3, 3, 3, 3]


def test_a_capture_not_ours_keeps_every_allocation():
    """A pass captured by a graph not ours (Megatron's CUDA graphs replay into the
    addresses they captured): nothing is released from then on; one captured by our pass
    replay (which records its waits) changes nothing."""
    ours = dist.run(_passes, 1, True, "ours", timeout=120)[0]
    assert [s["held"] for s in ours] == [11 * MIB, 6 * MIB, 16 * MIB] + [10 * MIB] * 3
    theirs = dist.run(_passes, 1, True, "theirs", timeout=120)[0]
    assert all(s["intact"] for s in theirs)
    assert [s["held"] for s in theirs] == [13 * MIB] * 2 + [29 * MIB] * 4  # doubling, kept


def _null_and_heap(rank, world):
    """The same passes (mixed dtypes) on `null` and on a freeing heap (symm's policy): per
    pass, each workspace's byte offset in the newest allocation, the bytes held, the
    generation; and whether a pass's workspaces all kept their own values."""
    from megatron_overlap.comm import NullTransport

    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    passes = [[((MIB,), torch.bfloat16), ((3, MIB // 8), torch.float32)],
              [((5 * MIB,), torch.float8_e4m3fn), ((MIB // 2,), torch.float32)],
              [((MIB,), torch.bfloat16), ((3, MIB // 8), torch.float32)],
              [((5 * MIB,), torch.float8_e4m3fn), ((MIB // 2,), torch.float32)]]
    out = {}
    for name, tp in (("heap", _cpu_heap(True)), ("null", NullTransport(world, rank))):
        seen = []
        for calls in passes:
            tp.begin_pass("p")
            views = [tp.workspace(shape, dtype) for shape, dtype in calls]
            newest = tp._bufs[-1] if name == "heap" else tp._heaps["cpu"].bufs[-1]
            finite = all(bool(v.float().isfinite().all()) for v in views)
            for i, v in enumerate(views):
                v.fill_(i)
            seen.append({"offsets": [v.data_ptr() - newest.local.data_ptr() for v in views],
                         "intact": all(bool((v.float() == i).all()) for i, v in enumerate(views)),
                         "held": tp.bytes_held, "generation": tp.generation, "finite": finite})
        out[name] = seen
    return out


def test_null_lays_out_and_keeps_its_workspaces_as_a_heap_does():
    """`null` (the compute-side benchmarks' transport) carves as `symm` does: a pass's
    workspaces side by side, the next pass on the same bytes, grown to the largest pass
    (not one buffer per workspace call), so a layer keeps on it what it keeps on `symm`;
    its random fill reads as finite numbers in every dtype."""
    got = dist.run(_null_and_heap, 1, timeout=120)[0]
    heap, null = got["heap"], got["null"]
    assert all(s["intact"] for s in heap + null)
    assert all(s["finite"] for s in null)
    # passes 3 and 4 (the largest seen before) fit: the same places as on the heap
    assert [s["offsets"] for s in null[2:]] == [s["offsets"] for s in heap[2:]]
    assert null[2]["offsets"] == [0, 2 * MIB] and null[3]["offsets"] == [0, 5 * MIB]
    largest = 5 * MIB + 2 * MIB  # pass 2: 5 MiB of e4m3, 2 MiB of fp32
    assert null[-1]["held"] == heap[-1]["held"] == grown_size(largest, True)
    # a growth moves the workspaces (a new generation; passes 1 and 2 outgrow twice
    # each, as on the heap); a pass that fits does not
    assert [s["generation"] for s in null] == [2, 4, 4, 4]


def test_null_fills_finite_refuses_growth_in_a_capture_and_keeps_what_a_foreign_one_saw(monkeypatch):
    """A new buffer of `null` reads finite in every floating dtype a pass may view it as;
    as on a heap, a growth inside a CUDA-graph capture is refused, and once a capture not
    ours (not inside our pass replay's `recording_waits`) has run a pass, no outgrown
    buffer is released (that graph replays into it)."""
    from megatron_overlap.comm import CommError, NullTransport
    from megatron_overlap.comm import null as null_mod

    tp = NullTransport(2)
    tp.begin_pass("a")
    tp.workspace((3 * MIB,), torch.uint8)
    (buf,) = tp.buffers()
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float16, torch.bfloat16,
                  torch.float32):
        assert bool(buf.view(dtype).float().isfinite().all()), dtype
    capturing = [False]
    monkeypatch.setattr(null_mod, "_capturing", lambda device: capturing[0])
    capturing[0] = True
    with tp.recording_waits():
        tp.begin_pass("captured by ours")
    tp.workspace((MIB,), torch.uint8)  # fits
    with pytest.raises(CommError, match="during CUDA-graph capture"):
        tp.workspace((8 * MIB,), torch.uint8)
    capturing[0] = False
    tp.begin_pass("b")
    tp.workspace((8 * MIB,), torch.uint8)  # grows: two buffers until the next pass
    assert len(tp.buffers()) == 2
    tp.begin_pass("c")
    assert len(tp.buffers()) == 1  # our captures pinned nothing: the outgrown one released
    capturing[0] = True
    tp.begin_pass("captured by a graph not ours")
    capturing[0] = False
    tp.begin_pass("d")
    tp.workspace((20 * MIB,), torch.uint8)
    tp.begin_pass("e")
    assert len(tp.buffers()) == 2  # pinned: kept


def _refused_in_capture(rank, world):
    from megatron_overlap.comm import CommError

    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    tp = _cpu_heap(True)
    tp.begin_pass("fc1_fprop")
    tp.capturing = True
    tp.workspace((MIB // 2,), torch.uint8)  # fits the 1 MiB it starts with
    try:
        tp.workspace((2 * MIB,), torch.uint8)
    except CommError as e:
        return str(e), tp.allocated
    return None, tp.allocated


def test_a_heap_refuses_to_grow_inside_a_capture_naming_rank_and_pass():
    msg, allocated = dist.run(_refused_in_capture, 1, timeout=120)[0]
    assert msg is not None and allocated == []
    assert msg.startswith("megatron_overlap[cpu_heap]: rank 0: 'fc1_fprop' needs ")
    assert "during CUDA-graph capture; run the layer once eagerly" in msg
