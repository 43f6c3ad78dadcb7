"""A TP=2 run on CPU (gloo) of one overlapped column- and row-parallel pair against
Megatron's own layers on the same weights: prints the per-layer settings, the
schedule each pass ran (from the transport trace) and the largest differences.

    python examples/layer_demo.py [--tp 2]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))  # Megatron-on-CPU shims

from helpers import dist  # noqa: E402


def _demo(rank: int, world: int) -> dict:
    import torch

    import megatron_overlap as mo
    from helpers.layers import Case, build, make_input, run_pair
    from helpers.megatron_cpu import init
    from megatron_overlap.comm import trace

    init(world)
    report = {}
    for case in (Case("column", True, "float32", True, False, "ring", seq=8),
                 Case("row", True, "float32", True, False, "pipeline4", seq=8)):
        ref = build(case, world, overlap=False)
        cfg = mo.install()
        try:
            ours = build(case, world, overlap=True)
        finally:
            mo.uninstall()
        ours.load_state_dict(ref.state_dict())
        x = make_input(case, rank, world, ref)
        with trace.recording() as events:
            errs = run_pair(ref, ours, x)
        report[case.kind] = {"errors": errs, "rows": ours.overlap_rows(),
                             "trace": [f"{e.kind}:{e.op}#{e.chunk}" for e in events
                                       if e.op.endswith(("fprop", "dgrad", "wgrad"))]}
    report["table"] = cfg.table("torch_p2p", tp_size=world)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args()
    report = dist.run(_demo, args.tp)[0]
    print(report["table"])
    for kind in ("column", "row"):
        r = report[kind]
        print(f"\n{kind}-parallel layer, rank 0 schedule: {' '.join(r['trace'])}")
        for name, err in r["errors"].items():
            print(f"  {name:14s} relative difference to Megatron: {err:.2e}")
        worst = max(r["errors"].values())
        print(f"  {'OK' if worst < 1e-5 else 'MISMATCH'} (fp32 tolerance 1e-5)")


if __name__ == "__main__":
    main()
