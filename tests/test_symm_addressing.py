"""Where `symm` writes into a peer (comm/symm.py `_remote`), on CPU memory: a workspace
tensor's place in the peer's part of the same allocation, counted from the handle's
buffer pointer. `symm`'s allocations are its own (base 0); torch maps a block of its
memory pool from the segment's start, which this holds the arithmetic to (base > 0).
A new allocation (of `symm` or `nvshmem`) is zero on the device before a peer can put
into it. The copies themselves are the GPU suite's."""

import types

import torch

from megatron_overlap.comm.heap import Buffer, HeapTransport
from megatron_overlap.comm.symm import SymmTransport

SEGMENT, BASE, SIZE = 8192, 1536, 4096  # the block starts BASE bytes into its segment


class Handle:
    """torch's _SymmetricMemory as `_remote` uses it: get_buffer counts from each rank's
    segment start."""

    def __init__(self, segments):
        self.segments = segments

    def get_buffer(self, rank, sizes, dtype, storage_offset):
        assert dtype == torch.uint8
        flat = self.segments[rank][storage_offset:]
        return flat[:torch.Size(sizes).numel()].view(sizes)


def test_a_peer_address_counts_from_the_handle_s_base():
    segments = [torch.zeros(SEGMENT, dtype=torch.uint8) for _ in range(2)]
    local = segments[0][BASE:BASE + SIZE]
    me = types.SimpleNamespace(rank=0, name="symm", _bufs=[Buffer(local, Handle(segments), BASE)])
    me._locate = types.MethodType(HeapTransport._locate, me)
    for dtype, at in ((torch.bfloat16, 256), (torch.float8_e4m3fn, 1024), (torch.float32, 0)):
        t = local[at:at + 512].view(dtype).view(4, -1)
        remote = SymmTransport._remote(me, t, 1, "op")
        assert remote.dtype == dtype and remote.shape == t.shape
        assert remote.data_ptr() == segments[1].data_ptr() + BASE + at  # the peer's same place
    assert SymmTransport._remote(me, t, 0, "op") is t  # this rank: the tensor itself


def test_a_new_allocation_is_zero_on_the_device_before_peers_can_map_it(monkeypatch):
    """A heap grown mid-pass: a peer ahead in the pass pushes into the new allocation as
    soon as `rendezvous` hands it the mapping, so this rank's zeroing must have run on the
    device by then, not merely be queued behind its work (which would wipe the push)."""
    import megatron_overlap.comm.symm as symm

    seen = []
    memory = torch.full((4096,), 0xAB, dtype=torch.uint8)

    class Stream:
        def synchronize(self):
            seen.append(("synchronize", bool((memory == 0).all())))

    class FakeSymm:
        _should_use_implicit_mempool = staticmethod(lambda: True)  # a torch with the pool

        class _SymmetricMemory:
            @staticmethod
            def empty_strided_p2p(size, stride, dtype, device):
                return memory[:size[0]]

        @staticmethod
        def rendezvous(local, group_name):
            seen.append(("rendezvous", bool((local == 0).all())))
            return types.SimpleNamespace(
                buffer_ptrs=[local.data_ptr()],
                get_buffer=lambda rank, sizes, dtype, offset: local[offset:])

    monkeypatch.setattr(symm, "_symm", lambda: FakeSymm)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    me = types.SimpleNamespace(rank=0, device=torch.device("cuda"),  # (not touched: stand-ins)
                               group=types.SimpleNamespace(group_name="tp"))
    me._device_sync = types.MethodType(HeapTransport._device_sync, me)
    buf = SymmTransport._alloc(me, 4096)
    assert seen == [("synchronize", True), ("rendezvous", True)]  # zeroed, done, then mapped
    assert buf.base == 0 and (buf.local == 0).all()


def test_nvshmem_zeroes_a_new_allocation_before_an_on_stream_barrier(monkeypatch):
    """The same for `nvshmem` (comm/nvshmem.py `_alloc`): NVSHMEM's allocation is collective
    on the hosts only, so each PE's zero is followed by a barrier on the stream it ran on,
    which a peer's first put into the new allocation is ordered after."""
    from megatron_overlap.comm.nvshmem import NvshmemTransport

    seen, memory = [], torch.full((4096,), 0xAB, dtype=torch.uint8)
    stream = types.SimpleNamespace(cuda_stream=7)
    me = types.SimpleNamespace(
        device=torch.device("cuda"), _tensors=[],
        _core=types.SimpleNamespace(interop=types.SimpleNamespace(torch=types.SimpleNamespace(
            bytetensor=lambda size, except_on_del: memory[:size[0]]))),
        _nb=types.SimpleNamespace(barrier_all_on_stream=lambda s: seen.append(
            ("barrier", s, bool((memory == 0).all())))),
        _watch=lambda s, what, slot: seen.append(("watched", s is stream)))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    buf = NvshmemTransport._alloc(me, 4096)
    assert seen == [("barrier", 7, True), ("watched", True)]  # zeroed, then the barrier, watched
    assert me._tensors == [buf.local] and (buf.local == 0).all()
