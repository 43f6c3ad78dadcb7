"""Checks inside the FP8 training run at TP > 1: `fp8_train.py`'s run (same flags), with
every pass of the FP8 arm's first --probe-steps steps checked where it happens:

1. every scaled GEMM against an fp32 product of the very FP8 operands and scales it was
   given (a wrong or partial GEMM, a scale misapplied, an `out=` not written: O(1); FP8
   products in bf16 are ~4e-3 off);
2. every amax the TP group shares (`group_amaxes`' max, the scale of a tensor that is gathered)
   against an all-reduce(MAX) of the ranks' own amaxes (a peer's amax read early or from
   the wrong place: the gathered rows would carry two scales);
3. every all-gather GEMM: the tensor it gathered, byte for byte, against the ranks' own
   rows sent over the process group, and its output against the fp32 product of those
   true rows (a block read before it landed, a wrong offset, rows shifted: one position is
   `micro_batch` rows in Megatron's [s, b, h] layout; a GEMM fed the wrong block);
4. every GEMM + reduce-scatter (or all-reduce): its output against the fp32 products of
   every rank summed over the process group, this rank's rows (a reduction that lands
   rows elsewhere);
5. every bulk all-gather, reduce-scatter and all-reduce of the transport (the column
   dgrad's gather of the FP8 input for the wgrad, the dgrad's reduce-scatter) against the
   same collective over the process group, once it has been waited for.

The pass replay is off (the checks read values on the host, which a capture cannot);
tensorwise scales only (`--fp8-scaling rowwise` is refused: its GEMMs are not checked).

    python benchmarks/probe_fp8_tp.py --steps 60 --out $OUT       # on a GPU: 2 ranks share it
    python benchmarks/probe_fp8_tp.py --device cpu --layers 2 --hidden 64 --heads 4 --seq 32 \\
        --micro-batch 2 --vocab 128 --steps 3 --out /tmp/p           # CPU: functional

Prints each check's worst value and count per rank and writes them to
<out>/probe_fp8_tp_<tag>_rank<r>.json, beside fp8_train's own results (<tag>: --tag or
'probe'). --probe-steps N: the FP8 arm's first N steps are checked (default 3).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fp8_train  # noqa: E402

Stats = dict[str, tuple[int, float]]


def _note(stats: Stats, key: str, value: float) -> None:
    n, worst = stats.get(key, (0, 0.0))
    stats[key] = (n + 1, max(worst, float(value)))


def _pg(t: torch.Tensor) -> torch.Tensor:
    """`t` where the process group's backend takes it (gloo: the host)."""
    return t.cpu() if dist.get_backend() == "gloo" else t


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """`t`'s rows as bytes (an FP8 or bf16 row compared bit for bit)."""
    return _pg(t).contiguous().view(torch.uint8)


def _gathered(t: torch.Tensor) -> torch.Tensor:
    """Every rank's `t`, in rank order, as bytes: what a gather of `t` must hold."""
    every = [torch.empty_like(_bytes(t)) for _ in range(dist.get_world_size())]
    dist.all_gather(every, _bytes(t))
    return torch.cat(every)


def _rows_wrong(got: torch.Tensor, true: torch.Tensor) -> float:
    """The share of `got`'s rows whose bytes differ from `true`'s (bytes too)."""
    return (_bytes(got) != true).any(-1).float().mean().item()


def _summed(t: torch.Tensor) -> torch.Tensor:
    """The sum of every rank's `t` (in fp64, then fp32)."""
    total = _pg(t).double().contiguous()
    dist.all_reduce(total)
    return total.float()


def _operands(gemm, x: torch.Tensor, w: torch.Tensor) -> tuple | None:
    """x and w as the GEMM reads them, in fp32 (None: a GEMM these checks do not know)."""
    from megatron_overlap.overlap import fp8, matmul

    if isinstance(gemm, fp8.ScaledGemm):
        return x.float() * gemm.a_inv, w.float() * gemm.b_inv
    if gemm is matmul:
        return x.float(), w.float()
    return None


class _Checked:
    """A transport's handle whose wait() also runs a check (once the transfer is done)."""

    def __init__(self, inner, check) -> None:
        self._inner, self._check = inner, check

    def wait(self) -> None:
        self._inner.wait()
        self._check()


def install_checks(stats: Stats) -> dict:
    """Wrap the FP8 GEMM, the shared amax, the two schedules and the transport's bulk
    collectives with the checks; they run while the returned switch's 'on' is True."""
    import megatron_overlap.layers.fp8 as layer_fp8
    import megatron_overlap.layers.functions as functions
    import megatron_overlap.overlap.fp8 as fp8
    from megatron_overlap.comm.transport import Transport
    from megatron_overlap.overlap import matmul

    switch = {"on": False}
    gemm_call, shared = fp8.ScaledGemm.__call__, fp8.group_amaxes
    gather_mm, mm_scatter = functions.all_gather_matmul, functions.matmul_reduce_scatter
    all_gather, reduce_scatter, all_reduce = (Transport.all_gather, Transport.reduce_scatter,
                                              Transport.all_reduce)

    def checked_gemm(self, a, b, out=None, *, op, chunk=0):
        res = gemm_call(self, a, b, out, op=op, chunk=chunk)
        if switch["on"]:
            x, w = _operands(self, a, b)  # (3-D: batched, `b` expanded)
            _note(stats, f"gemm {op}: |fp8 - fp32| / |fp32|", fp8_train.rel_error(res, x @ w))
        return res

    def checked_amax(x, tp, op):
        every = shared(x, tp, op)
        if switch["on"]:
            true = _pg(fp8.amax(x).float().reshape(1))
            dist.all_reduce(true, op=dist.ReduceOp.MAX)
            m = every.amax()
            _note(stats, f"{op}: |shared - true| / true",
                  abs(m.item() - true.item()) / max(true.item(), 1e-30))
        return every

    def checked_gather_mm(x, w, tp, method, **kw):
        out, gathered = gather_mm(x, w, tp, method, **kw)
        if switch["on"]:
            op, true = kw.get("op"), _gathered(x)
            _note(stats, f"{op}: gathered rows wrong (share)", _rows_wrong(gathered, true))
            ops = _operands(kw.get("gemm", matmul), true.view(x.dtype).to(x.device), w)
            if ops is not None:
                _note(stats, f"{op}: output vs the true rows' product", fp8_train.rel_error(out, ops[0] @ ops[1].t()))
        return out, gathered

    def checked_mm_scatter(x, w, tp, method, num_splits, **kw):
        out = mm_scatter(x, w, tp, method, num_splits, **kw)
        if switch["on"] and kw.get("chunk_major"):  # x's rows laid out for the pipeline
            x = fp8.chunk_major(x, num_splits, tp.world_size)  # back in their order
        ops = _operands(kw.get("gemm", matmul), x, w) if switch["on"] else None
        if ops is not None:
            total = _summed(ops[0] @ ops[1].t())
            if kw.get("scatter", True):
                total = total.chunk(tp.world_size)[tp.rank]
            _note(stats, f"{kw.get('op')}: output vs every rank's product summed",
                  fp8_train.rel_error(_pg(out), total))
        return out

    def checked_all_gather(self, out, inp, *, op, chunk=0):
        handle = all_gather(self, out, inp, op=op, chunk=chunk)
        if not switch["on"]:
            return handle
        return _Checked(handle, lambda: _note(stats, f"{op} (bulk gather): rows wrong (share)",
                                              _rows_wrong(out, _gathered(inp))))

    def checked_reduce_scatter(self, out, inp, *, op, chunk=0):
        handle = reduce_scatter(self, out, inp, op=op, chunk=chunk)
        if not switch["on"]:
            return handle
        return _Checked(handle, lambda: _note(
            stats, f"{op} (bulk reduce-scatter): vs the process group's",
            fp8_train.rel_error(_pg(out), _summed(inp).chunk(self.world_size)[self.rank])))

    def checked_all_reduce(self, tensor, *, op, chunk=0):
        before = tensor.clone() if switch["on"] else None
        handle = all_reduce(self, tensor, op=op, chunk=chunk)
        if before is None:
            return handle
        return _Checked(handle, lambda: _note(stats, f"{op} (bulk all-reduce): vs the process group's",
                                              fp8_train.rel_error(_pg(tensor), _summed(before))))

    fp8.ScaledGemm.__call__ = checked_gemm
    fp8.group_amaxes = layer_fp8.group_amaxes = checked_amax
    functions.all_gather_matmul, functions.matmul_reduce_scatter = checked_gather_mm, checked_mm_scatter
    Transport.all_gather, Transport.reduce_scatter = checked_all_gather, checked_reduce_scatter
    Transport.all_reduce = checked_all_reduce
    return switch


def worker(rank: int, world: int, args: argparse.Namespace) -> None:
    from megatron_overlap.ab import train

    stats: Stats = {}
    switch = install_checks(stats)
    step = train.TrainArm.step

    def checked_step(self, batch):
        switch["on"] = self.name == "fp8" and len(self.results) < args.probe_steps
        try:
            return step(self, batch)
        finally:
            switch["on"] = False

    train.TrainArm.step = checked_step
    fp8_train.worker(rank, world, args)  # destroys the process group at its end
    print("\n".join(f"probe rank {rank}: {k}: worst {worst:.3e} over {n}"
                    for k, (n, worst) in sorted(stats.items())), flush=True)
    tag = args.tag or "probe"
    with open(os.path.join(args.out, f"probe_fp8_tp_{tag}_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "world": world, "probe_steps": args.probe_steps,
                   "checks": {k: {"count": n, "worst": w} for k, (n, w) in stats.items()}}, f, indent=1)


def main(argv=None) -> int:
    from megatron_overlap.ab.launch import launch

    ap = fp8_train.build_parser()
    ap.description = __doc__
    ap.add_argument("--probe-steps", type=int, default=3, help="the FP8 arm's steps checked")
    args = fp8_train.parse_args(argv, ap)
    if args.fp8_scaling != "tensorwise":
        raise SystemExit("probe_fp8_tp: --fp8-scaling rowwise: its row-scaled GEMMs are not "
                         "checked here; probe the tensorwise recipe")
    os.makedirs(args.out, exist_ok=True)
    os.environ["MEGATRON_OVERLAP_GRAPHS"] = "0"
    launch(worker, args.tp, args, device=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
