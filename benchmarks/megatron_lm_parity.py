"""Compare two Megatron-LM pretrain_gpt.py logs, overlap on and off, iteration by iteration.

    python benchmarks/megatron_lm_parity.py ON.log OFF.log --iters 20 [--label TAG] [--json OUT]

Reads Megatron-LM's per-iteration lines (`iteration N/M | ... lm loss: X | ... grad norm: G`)
and megatron_lm_shared_gpu.py's layer counts, prints a table, and exits 1 unless: both
logs have every iteration 1..iters, the losses are equal at every iteration (as Megatron
prints them), the ON arm went through megatron_overlap.install for --tp-comm-overlap and
built overlapped layers, and the OFF arm built none.

`--attention`: the two logs are the overlap on with torch's attention (the default) and with
Megatron's (--megatron-overlap-attention megatron); their losses must agree within --rel-tol
(bf16: different attention kernels round differently), the first built our attention in
every layer and the second none.

`--packed`: both runs packed documents into each sequence (`--dataloader-inter-document-masking`
or `--sft`: THD batches with cu_seqlens); besides the parity, each must have called our
attention with packed sequences on every rank.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ITER = re.compile(r"iteration\s+(\d+)/\s*\d+ \|(.*)")
FIELD = re.compile(r"\s*([a-z][a-z /()-]*?):\s*([-+0-9.eE]+|nan|inf)\s*\|", re.I)
LAYERS = re.compile(r"MLM-PARITY-LAYERS (\{[^{}]*\})")  # ranks may print on one line
REPLAYS = re.compile(r"MLM-REPLAYS (\{[^{}]*\})")


def read(path: Path) -> dict:
    text = path.read_text(errors="replace")
    iters: dict[int, dict[str, str]] = {}
    for line in text.splitlines():
        m = ITER.search(line)
        if m:
            iters[int(m.group(1))] = {k.strip(): v for k, v in FIELD.findall(m.group(2) + "|")}
    built = [json.loads(m.group(1)) for m in LAYERS.finditer(text)]
    replays = sorted((json.loads(m.group(1)) for m in REPLAYS.finditer(text)), key=lambda r: r["rank"])
    installed = re.findall(r"megatron_overlap\.install\((.*?)\): (.*?) \[", text)
    version = re.search(r"megatron-core ([0-9][^ )]*)", text)
    return {"iters": iters, "built": built, "installed": installed, "replays": replays,
            "version": version.group(1) if version else "?"}


def _built(log: dict, prefix: str) -> int:
    return sum(v for r in log["built"] for k, v in r.items() if k.startswith(prefix))


def _attention(on: dict, off: dict) -> list[str]:
    """The --attention arms: torch's attention in every layer of the first, none in the second."""
    errors = []
    for label, log, want, built in (("first", on, "'torch'", True), ("second", off, "'megatron'", False)):
        if not any(f"attention={want}" in args for args, _ in log["installed"]):
            errors.append(f"{label}: megatron_overlap.install was not called with attention={want}")
        if bool(_built(log, "TorchDotProductAttention")) != built:
            errors.append(f"{label}: {_built(log, 'TorchDotProductAttention')} TorchDotProductAttention built")
    return errors


def compare(on: dict, off: dict, iters: int, off_overlapped: bool = False,
            losses_only: bool = False, rel_tol: float = 0.0) -> tuple[list[list[str]], list[str]]:
    """Rows and errors; `off_overlapped`: the second log is an overlapped run too (the
    eager one that a CUDA-graphed run is compared with); `losses_only`: two runs of any
    kind, their losses alone (Megatron's linears graphed against eager); `rel_tol`: how far
    the losses may differ, relative (0: equal as printed)."""
    rows, errors = [], []
    for i in range(1, iters + 1):
        a, b = on["iters"].get(i, {}), off["iters"].get(i, {})
        la, lb = a.get("lm loss"), b.get("lm loss")
        if la is None or lb is None:
            errors.append(f"iteration {i}: no lm loss in the {'on' if la is None else 'off'} log")
        elif abs(float(la) - float(lb)) > rel_tol * abs(float(lb)):
            errors.append(f"iteration {i}: lm loss {la} (on) != {lb} (off)"
                          + (f" beyond {rel_tol:g} relative" if rel_tol else ""))
        rows.append([str(i), la or "-", lb or "-", "=" if la == lb and la else "DIFF",
                     a.get("grad norm", "-"), b.get("grad norm", "-"),
                     a.get("elapsed time per iteration (ms)", "-"),
                     b.get("elapsed time per iteration (ms)", "-")])
    if losses_only:
        return rows, errors
    if not any(why == "--tp-comm-overlap" for _, why in on["installed"]):
        errors.append("on: megatron_overlap.install was not called for --tp-comm-overlap")
    n_on, n_off = _built(on, "Overlap"), _built(off, "Overlap")
    if not on["built"] or n_on == 0:
        errors.append(f"on: no overlapped layer was built ({on['built']})")
    if off_overlapped:
        if n_off != n_on:
            errors.append(f"second run built {n_off} overlapped layers, the first {n_on}")
        return rows, errors
    if not off["installed"] or any(why == "--tp-comm-overlap" for _, why in off["installed"]):
        errors.append("off: expected install with every overlap off, got "
                      f"{off['installed'] or 'none'}")
    if n_off:
        errors.append(f"off: {n_off} overlapped layers were built")
    return rows, errors


def _packed(on: dict, off: dict) -> list[str]:
    """Every rank of both runs called our attention with packed sequences."""
    return [f"{label}: rank {r.get('rank')} ran no packed attention call"
            for label, log in (("on", on), ("off", off)) for r in log["built"] or [{}]
            if not r.get("packed_attention_calls")]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("on", type=Path)
    ap.add_argument("off", type=Path)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--label", default="")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--second-overlapped", action="store_true",
                    help="the second log is an overlapped run too (CUDA graphs vs eager)")
    ap.add_argument("--losses-only", action="store_true",
                    help="compare the losses alone (two runs of Megatron's linears)")
    ap.add_argument("--attention", action="store_true",
                    help="the logs: torch's attention, then Megatron's (both overlapped)")
    ap.add_argument("--packed", action="store_true",
                    help="both runs packed sequences: each called our attention with them")
    ap.add_argument("--rel-tol", type=float, default=None,
                    help="relative loss difference allowed (default 0; 1e-2 with --attention)")
    a = ap.parse_args(argv)
    on, off = read(a.on), read(a.off)
    tol = a.rel_tol if a.rel_tol is not None else (1e-2 if a.attention else 0.0)
    rows, errors = compare(on, off, a.iters, a.second_overlapped or a.attention, a.losses_only, tol)
    if a.attention:
        errors += _attention(on, off)
    if a.packed:
        errors += _packed(on, off)
    head = ["iter", "loss on", "loss off", "", "grad norm on", "grad norm off", "ms on", "ms off"]
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]
    print(f"== {a.label} (megatron-core {on['version']}): overlap on vs every overlap off; "
          f"overlapped layers built per rank: {on['built']} (on), {off['built']} (off)")
    for r in [head, *rows]:
        print("  ".join(x.rjust(w) for x, w in zip(r, widths)))
    for arm, log in (("on", on), ("second", off) if a.second_overlapped else (None, None)):
        if arm and log["replays"]:
            print(f"layer passes replayed / run per iteration ({arm}): " + "; ".join(
                f"rank {r['rank']}: " + " ".join(f"{rep}/{calls}" for calls, rep, *_ in r["per_iter"])
                + f" (captures {sum(it[2] for it in r['per_iter'])}"
                + (f", evictions {sum(it[3] for it in r['per_iter'])}" if
                   all(len(it) > 3 for it in r["per_iter"]) else "") + ")"
                for r in log["replays"]))
    print("PARITY " + ("OK" if not errors else "FAILED: " + "; ".join(errors)), flush=True)
    if a.json:
        a.json.write_text(json.dumps({"label": a.label, "version": on["version"], "rows": rows,
                                      "errors": errors, "built_on": on["built"],
                                      "replays_on": on["replays"]}, indent=1))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
