"""Where torch's symmetric memory puts a tensor inside what its handle maps, for the
allocations a growing heap makes (1 MiB, then larger, the earlier ones kept, one freed
and a new one made), through `symm_mem.empty` (torch's implicit memory pool where this
torch has one) and through the allocation `comm/symm.py` makes (one of its own). A
non-zero `base` (the tensor's data pointer minus the handle's buffer pointer for this
rank) is an address a peer must add: `symm`'s heap counts peer addresses from the
handle's pointer for that reason. Also: whether the handle's `get_buffer` at that base
is the tensor itself, and whether both ranks got the same base.

    torchrun --nproc-per-node 2 benchmarks/probe_symm_pool.py      # ranks sharing GPU 0

Prints one line per allocation (rank 0) and writes $OUT/probe_symm_pool.json when OUT is set.
"""
import json
import os

import torch
import torch.distributed as dist
import torch.distributed._symmetric_memory as symm_mem

MIB = 1 << 20
SIZES = (256, MIB, 4 * MIB, 9 * MIB, 20 * MIB, 64 * MIB)


def allocate(how: str, nbytes: int) -> torch.Tensor:
    if how == "pool":
        return symm_mem.empty(nbytes, dtype=torch.uint8, device="cuda")
    return symm_mem._SymmetricMemory.empty_strided_p2p((nbytes,), (1,), torch.uint8,
                                                       torch.device("cuda", 0))


def where(t: torch.Tensor, rank: int) -> dict:
    handle = symm_mem.rendezvous(t, dist.group.WORLD.group_name)
    base = t.data_ptr() - handle.buffer_ptrs[rank]
    try:
        same = handle.get_buffer(rank, (t.numel(),), torch.uint8, base).data_ptr() == t.data_ptr()
    except RuntimeError as e:  # the handle's size check
        same = f"get_buffer: {str(e).splitlines()[0][:100]}"
    return {"bytes": t.numel(), "base": base, "get_buffer_is_tensor": same,
            "handle_size": handle.buffer_size}


def main() -> None:
    os.environ.setdefault("TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES", "1")
    dist.init_process_group("gloo")
    torch.cuda.set_device(0)
    rank = dist.get_rank()
    out = {"torch": torch.__version__,
           "implicit_pool": getattr(symm_mem, "_should_use_implicit_mempool", lambda: None)()}
    for how in ("pool", "own"):
        if how == "own" and out["implicit_pool"] is None:
            continue  # no pool in this torch: empty() makes allocations of their own
        rows, kept = [], []
        for nbytes in SIZES:
            t = allocate(how, nbytes)
            kept.append(t)
            rows.append(where(t, rank))
        del kept[2]  # one released, as the heap releases what it outgrew
        torch.cuda.synchronize()
        t = allocate(how, 6 * MIB)
        kept.append(t)
        rows.append({**where(t, rank), "after_a_free": True})
        bases = [None] * dist.get_world_size()
        dist.all_gather_object(bases, [r["base"] for r in rows])
        for r, *others in zip(rows, *bases):
            r["bases_on_every_rank"] = others
        out[how] = rows
    if rank == 0:
        for how in ("pool", "own"):
            for r in out.get(how, []):
                print(f"{how:4s} {r['bytes']:>10d} B: base {r['base']:>10d} (every rank: "
                      f"{r['bases_on_every_rank']}), get_buffer is the tensor: "
                      f"{r['get_buffer_is_tensor']}{', after a free' if r.get('after_a_free') else ''}",
                      flush=True)
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "probe_symm_pool.json"), "w") as f:
                json.dump(out, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
