"""Where `symm` writes into a peer (comm/symm.py `_remote`), on CPU memory: a workspace
tensor's place in the peer's part of the same allocation, counted from the handle's
buffer pointer. `symm`'s allocations are its own (base 0); torch maps a block of its
memory pool from the segment's start, which this holds the arithmetic to (base > 0).
The copies themselves are the GPU suite's."""

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
