"""Checks inside the FP8 training run at TP > 1: `fp8_train.py`'s run (same flags), with
every FP8 pass of the FP8 arm's first --probe-steps steps checked where it happens:

1. every scaled GEMM against an fp32 product of the very FP8 operands and scales it was
   given (a wrong or partial GEMM, a scale misapplied, an `out=` not written: O(1); FP8
   products in bf16 are ~4e-3 off);
2. every amax the TP group shares (`shared_amax`, the scale of a tensor that is gathered)
   against an all-reduce(MAX) of the ranks' own amaxes over the process group (a peer's
   amax read early or from the wrong place: the gathered rows would carry two scales);
3. every FP8 tensor an all-gather GEMM gathered, byte for byte, against the ranks' own
   rows sent over the process group (a block read before it landed, a wrong offset, rows
   shifted: one position is `micro_batch` rows in Megatron's [s, b, h] layout).

The pass replay is off (the checks read values on the host, which a capture cannot).

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


def install_checks(stats: Stats) -> dict:
    """Wrap the FP8 GEMM, the shared amax and the all-gather GEMM with the checks; they
    run while the returned switch's 'on' is True."""
    import megatron_overlap.layers.fp8 as layer_fp8
    import megatron_overlap.layers.functions as functions
    import megatron_overlap.overlap.fp8 as fp8
    from megatron_overlap.comm.transport import FLOAT8

    switch = {"on": False}
    gemm, shared, gather_mm = fp8.ScaledGemm.__call__, fp8.shared_amax, functions.all_gather_matmul

    def checked_gemm(self, a, b, out=None, *, op, chunk=0):
        res = gemm(self, a, b, out, op=op, chunk=chunk)
        if switch["on"]:
            pairs = zip(a, b) if a.dim() == 3 else [(a, b)]
            ref = torch.stack([(x.float() * self.a_inv) @ (w.float() * self.b_inv) for x, w in pairs])
            ref = ref.view(res.shape)
            _note(stats, f"gemm {op}: |fp8 - fp32| / |fp32|",
                  ((res.float() - ref).norm() / ref.norm().clamp_min(1e-30)).item())
        return res

    def checked_amax(x, tp, op):
        m = shared(x, tp, op)
        if switch["on"]:
            true = fp8.amax(x).float().cpu().reshape(1)
            dist.all_reduce(true, op=dist.ReduceOp.MAX)  # the process group: the TP ranks here
            _note(stats, f"{op}: |shared - true| / true",
                  abs(m.item() - true.item()) / max(true.item(), 1e-30))
        return m

    def checked_gather(x, w, tp, method, **kw):
        out, gathered = gather_mm(x, w, tp, method, **kw)
        if switch["on"] and x.dtype in FLOAT8:
            mine = x.view(torch.uint8).cpu()
            every = [torch.empty_like(mine) for _ in range(tp.world_size)]
            dist.all_gather(every, mine)
            wrong = gathered.view(torch.uint8).cpu() != torch.cat(every)
            _note(stats, f"{kw.get('op')}: gathered bytes wrong (share)", wrong.float().mean().item())
        return out, gathered

    fp8.ScaledGemm.__call__ = checked_gemm
    fp8.shared_amax = layer_fp8.shared_amax = checked_amax
    functions.all_gather_matmul = checked_gather
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

    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--probe-steps", type=int, default=3, help="the FP8 arm's steps checked")
    own, rest = ap.parse_known_args(argv)
    args = fp8_train.parse_args(rest)
    args.probe_steps = own.probe_steps
    os.makedirs(args.out, exist_ok=True)
    os.environ["MEGATRON_OVERLAP_GRAPHS"] = "0"
    launch(worker, args.tp, args, device=args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
