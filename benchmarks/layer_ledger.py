"""The ledger of one transformer layer's forward + backward: every device operation it
issues, with the bytes it reads and writes, its FLOPs and where in the code it comes from,
for two arms of the same layer (--pair): fp8, the bf16 and the FP8 layer install() builds;
attention, the layer with a plain causal SDPA call against install()'s core attention;
overlap, Megatron's linears against our overlapped linears (bf16, install()'s attention in
both); fp8_micro, the FP8 layer quantizing its weights at every forward against the same at
a step's later micro-batches, its FP8 weights reused (benchmarks/fp8_layer.py's arms). METHOD's first step for benchmarks/fp8_layer.py and attention_layer.py: count before
timing, so that the time one arm costs beyond the other has a name and a size.

Runs on a CPU at the full per-rank shapes, in seconds: one process plays the last TP rank
(fp8_layer's set-up, the mirror transport), and a dispatch mode records each aten call.
The GEMMs and the core attention are recorded but not computed (their outputs are zeros
of the right shape, strides and dtype, from the op's meta kernel): their FLOPs and bytes
are what counts here, and their time is benchmarks/fp8_compute.py's. Everything else runs,
so its shapes, dtypes and layouts are the layer's own. As on a GPU, each of the compiled
FP8 kernels (the fused cast, the transposed copy, the scale: `overlap.fp8._run_compiled`,
which compiles only on CUDA) is one operation here (the same function run eagerly,
recorded once).

Each recorded operation is one kernel launch (an approximation: a few aten ops launch two),
classed as gemm, attention, comm (the emulated transport's copies: what a real transport
moves), fp8 cast, transpose (a copy whose innermost dimension changes), copy, reduction or
elementwise; the last five are the memory-bound rest. Views and allocations launch nothing
and are left out; an expanded (stride 0) operand counts its bytes once. Where:
the innermost frame in megatron_overlap (else in megatron, else torch). Predicted time of
the memory-bound rest: bytes / --bandwidth + launches x --launch-us (stated assumptions,
not measurements; the device's copy bandwidth is to be measured, METHOD.md).

    python benchmarks/layer_ledger.py [--pair fp8|overlap|fp8_micro|attention] [--shapes all] [--top 12]
    python benchmarks/layer_ledger.py --shapes tiny           # seconds; what tests run

Writes <out>/layer_ledger_<pair>_<tag>.json (every operation of both arms) and prints, per
shape, the totals by class for each arm and the second arm's largest sites beyond GEMMs.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import sys
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import attention_layer as al  # noqa: E402  (shapes, command line, the run loop)
import fp8_layer  # noqa: E402  (the bf16 and FP8 arms)
import layer_compute as lc  # noqa: E402

aten = torch.ops.aten
GEMMS = {aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten._scaled_mm}
NO_KERNEL = {aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty,
             aten.new_empty_strided, aten.detach, aten.lift_fresh, aten.record_stream,
             aten._unsafe_view,
             aten.set_, aten.resize_, aten.is_nonzero, aten.sym_size, aten.sym_stride,
             aten.sym_numel, aten.sym_storage_offset}
OVERWRITE = {aten.copy_, aten.fill_, aten.zero_, aten.normal_, aten.uniform_}
FP8_TYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
CLASSES = ("gemm", "attention", "comm", "fp8 cast", "transpose", "copy", "reduction",
           "elementwise")
HEAVY = ("gemm", "attention", "comm")  # not in the memory-bound rest
REDUCTIONS = ("amax", "max", "min", "sum", "mean", "norm", "var", "prod", "argmax", "all", "any")
ROOT = os.path.dirname(HERE)


@dataclass
class Op:
    name: str
    cls: str
    site: str
    phase: str
    read: int  # bytes
    written: int
    flops: float = 0.0
    shapes: list = field(default_factory=list)


def _bytes(t: torch.Tensor) -> int:
    """The distinct bytes `t` holds: an expanded dimension (stride 0) counted once."""
    return math.prod(n for n, st in zip(t.shape, t.stride()) if st != 0) * t.element_size()


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _site() -> str:
    """The innermost public function in megatron_overlap that issued it, with its public
    caller there ('file:function <- file:function'; private helpers skipped); else the
    innermost in megatron; else torch's autograd."""
    f, ours, fallback = sys._getframe(2), [], None
    while f is not None and len(ours) < 2:
        path = f.f_code.co_filename
        if "megatron_overlap" + os.sep in path and os.sep + "benchmarks" + os.sep not in path:
            if not f.f_code.co_name.startswith("_") or f.f_code.co_name.startswith("__"):
                ours.append(f"{path.split('megatron_overlap' + os.sep, 1)[1]}:{f.f_code.co_name}")
        elif ours:
            break
        elif fallback is None and os.sep + "megatron" + os.sep in path:
            fallback = f"megatron/{path.split(os.sep + 'megatron' + os.sep, 1)[1]}:{f.f_code.co_name}"
        f = f.f_back
    return " <- ".join(ours) or fallback or "torch (autograd)"


def _emulated_transfer() -> bool:
    """Whether the innermost megatron_overlap frame is the emulated transport's."""
    f = sys._getframe(2)
    while f is not None:
        path = f.f_code.co_filename
        if "megatron_overlap" + os.sep in path:
            return path.endswith(os.path.join("ab", "emulated_tp.py"))
        f = f.f_back
    return False


def _gemm_flops(func, args, out: torch.Tensor) -> float:
    a = args[1] if func in (aten.addmm, aten.baddbmm) else args[0]
    return 2.0 * out.numel() * a.shape[-1]


def _inner(t: torch.Tensor) -> int:
    """The dimension `t`'s consecutive elements run along (of those longer than 1)."""
    dims = [d for d in range(t.dim()) if t.shape[d] > 1 and t.stride(d) != 0]
    return min(dims, key=lambda d: t.stride(d)) if dims else -1


def _classify(func, args, outs: list[torch.Tensor]) -> str:
    name = func.__name__
    if func in GEMMS:
        return "gemm"
    if "scaled_dot_product" in name or "flash_attention" in name or "efficient_attention" in name:
        return "attention"
    ins = _tensors(args)
    if outs and outs[0].dtype in FP8_TYPES and ins and ins[0].dtype not in FP8_TYPES:
        return "fp8 cast"
    if name.startswith(("copy", "clone", "_to_copy", "contiguous")) and ins and outs:
        src, dst = ins[-1] if name.startswith("copy") else ins[0], outs[0]
        return "transpose" if _inner(src) != _inner(dst) else "copy"
    if any(r in name for r in REDUCTIONS):
        return "reduction"
    return "elementwise"


class Ledger(TorchDispatchMode):
    """Records every kernel-launching aten call; GEMMs and attention are not computed."""

    def __init__(self):
        super().__init__()
        self.ops: list[Op] = []
        self.recording, self.phase = False, "forward"

    def add(self, op: Op) -> None:
        if self.recording:
            self.ops.append(op)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        packet = func.overloadpacket
        if packet in NO_KERNEL or func.is_view:
            return func(*args, **kwargs)
        heavy = packet in GEMMS or _classify(packet, args, []) == "attention"
        if heavy:
            out = self._shaped_zeros(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        outs = _tensors(out)
        if not self.recording:
            return out
        ins = _tensors((args, {k: v for k, v in kwargs.items() if k != "out"}))
        written = sum(map(_bytes, outs))
        read = sum(map(_bytes, ins))
        if packet.__name__.endswith("_") and ins:  # in place: self is written, and read
            written = max(written, _bytes(ins[0]))  # unless overwritten whole
            if packet in OVERWRITE:
                read -= _bytes(ins[0])
        site = _site()
        cls = "comm" if _emulated_transfer() else _classify(packet, args, outs)
        flops = _gemm_flops(packet, args, outs[0]) if cls == "gemm" else 0.0
        self.add(Op(packet.__name__, cls, site, self.phase, read, written, flops,
                    [list(t.shape) for t in ins[:3]]))
        return out

    @staticmethod
    def _shaped_zeros(func, args, kwargs):
        """What `func` returns, as zeros: shapes, strides and dtypes from its meta kernel;
        an `out=` tensor is zeroed and returned."""
        if "out" in kwargs:
            with _disable_current_modes():
                return kwargs["out"].zero_()
        meta = lambda t: (torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")  # noqa: E731
                          if isinstance(t, torch.Tensor) else t)
        got = func(*tree_map(meta, args), **tree_map(meta, kwargs))
        with _disable_current_modes():
            return tree_map(lambda t: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).zero_()
                            if isinstance(t, torch.Tensor) else t, got)


COMPILED = {"cast": "fp8 cast", "transpose": "transpose", "scale": "elementwise",
            "delayed_cast": "fp8 cast", "delayed_update": "elementwise",
            "cast_transpose": "fp8 cast", "delayed_cast_amax": "fp8 cast",
            "delayed_cast_amax_t": "fp8 cast", "amax": "reduction",
            "current_cast": "fp8 cast", "current_cast_t": "fp8 cast"}
# a kernel's trailing arguments it writes (else its last one): the delayed cast writes the
# scale it used and the FP8 tensor (its amax is torch's reduction, recorded as such; the
# amax kernel, like torch's, also launches the memset of its scalar, not recorded); the
# cast-transpose both layouts; delayed scaling's cast with its amax the scale used, the
# amax and the FP8 tensor (and its transpose); current scaling's cast the scale pair it
# made and the FP8 tensor (and its transpose); the update (arguments: histories, every
# rank's amaxes, scales) is recorded writing its scales, the histories' rewrite left out,
# as the cost model leaves out the histories' bytes
OUTPUTS = {"delayed_cast": 2, "cast_transpose": 2, "delayed_cast_amax": 3,
           "delayed_cast_amax_t": 4, "current_cast": 2, "current_cast_t": 3}


@contextlib.contextmanager
def compiled_kernels(ledger: Ledger):
    """A GPU's compiled FP8 kernels (`overlap.fp8._run_compiled`, CUDA only: the fused
    cast, the transposed copy, the scale, delayed scaling's cast and update) as one
    recorded operation each: the same numbers (the function run eagerly, unrecorded), one
    launch, its inputs read once and its outputs (the last argument, or `OUTPUTS`) written
    once."""
    from megatron_overlap.overlap import fp8

    def run(key: tuple, fn, *args: torch.Tensor, dynamic: bool = True, chunks=None,
            consts=None) -> bool:
        if not fp8._fusing:
            return False
        with _disable_current_modes():
            fn(*args)
        split = len(args) - OUTPUTS.get(key[0], 1)
        ins, outs = args[:split], args[split:]
        ledger.add(Op(f"compiled {key[0]}", COMPILED[key[0]], _site(), ledger.phase,
                      sum(map(_bytes, ins)), sum(map(_bytes, outs)), 0.0,
                      [list(t.shape) for t in ins]))
        return True

    original, fp8._run_compiled = fp8._run_compiled, run
    try:
        yield
    finally:
        fp8._run_compiled = original


@contextlib.contextmanager
def fused_activation(ledger: Ledger):
    """A GPU's SwiGLU fused with its casts (`overlap.fp8_act._fused`, CUDA only) as the
    kernels it launches: current scaling an amax (reading y, and the gradient, writing its
    scalar) and a cast (reading them again and the amax, writing the FP8 layouts and the
    scale pair); delayed scaling one cast (reading the history's scale too, writing the
    amax beside). The same numbers (its eager definition, unrecorded)."""
    from megatron_overlap.overlap import fp8, fp8_act

    def fused(act, y, g, dtype, pair, out, out_t, chunks, state, amax_out) -> bool:
        if not fp8._fusing:
            return False
        with _disable_current_modes():
            before = fp8.set_fused(False)
            try:
                fp8_act._eager(act, y, g, dtype, pair, out, out_t, chunks, state, amax_out)
            finally:
                fp8.set_fused(before)
        ins = [t for t in (y, g) if t is not None]
        read, shapes = sum(map(_bytes, ins)), [list(t.shape) for t in ins]
        written = sum(_bytes(t) for t in (out, out_t, pair) if t is not None)
        if state is None:
            ledger.add(Op(f"fused {act} amax", "reduction", _site(), ledger.phase, read, 4, 0.0,
                          shapes))
            ledger.add(Op(f"fused {act} cast", "fp8 cast", _site(), ledger.phase, read + 4,
                          written, 0.0, shapes))
        else:
            ledger.add(Op(f"fused {act} cast", "fp8 cast", _site(), ledger.phase, read + 8,
                          written + 4, 0.0, shapes))
        return True

    original, fp8_act._fused = fp8_act._fused, fused
    try:
        yield
    finally:
        fp8_act._fused = original


def record(arm: lc.Arm, e: lc.Extras) -> list[Op]:
    """One warm-up step (the arm's own `step`: first-call work, and whatever an arm does
    before its steady state, out of the record), then one recorded step."""
    ledger = Ledger()
    with compiled_kernels(ledger), fused_activation(ledger), ledger:
        arm.step(e)
        arm.x.grad = None
        for p in arm.layer.parameters():
            p.grad = None
        ledger.recording, ledger.phase = True, "forward"
        out, _ = arm.layer(arm.x, attention_mask=e.mask, rotary_pos_emb=e.rope)
        ledger.phase = "backward"
        out.backward(e.grad)
    return ledger.ops


def totals(ops: list[Op], bandwidth: float, launch_us: float) -> dict:
    """Per class: launches, MiB read + written, GFLOP; the memory-bound rest's predicted us."""
    by = {c: {"launches": 0, "mib": 0.0, "gflop": 0.0} for c in CLASSES}
    for op in ops:
        t = by[op.cls]
        t["launches"] += 1
        t["mib"] += (op.read + op.written) / 2**20
        t["gflop"] += op.flops / 1e9
    for c, t in by.items():
        t["predicted_us"] = (None if c in HEAVY else
                             t["mib"] * 2**20 / (bandwidth * 1e12) * 1e6 + t["launches"] * launch_us)
    rest = [t for c, t in by.items() if c not in HEAVY]
    by["rest"] = {k: sum(t[k] for t in rest) for k in ("launches", "mib", "gflop", "predicted_us")}
    return by


def sites(ops: list[Op], top: int) -> list[dict]:
    """The largest sites of the memory-bound rest, by bytes: (site, op, class)."""
    agg: dict = collections.defaultdict(lambda: {"launches": 0, "mib": 0.0})
    for op in ops:
        if op.cls in HEAVY:
            continue
        a = agg[(op.site, op.name, op.cls, op.phase)]
        a["launches"] += 1
        a["mib"] += (op.read + op.written) / 2**20
    rows = [{"site": s, "op": n, "class": c, "phase": p, **v} for (s, n, c, p), v in agg.items()]
    return sorted(rows, key=lambda r: -r["mib"])[:top]


def _fp8_pair(shape, args, dtype, device):
    arms, e = fp8_layer.build_arms(shape, args, dtype, device)
    return [a for a in arms if a.name in ("bf16", "fp8")], e


def _micro_pair(shape, args, dtype, device):
    arms, e = fp8_layer.build_arms(shape, args, dtype, device)
    return [a for a in arms if a.name in ("fp8", "fp8_later_micro")], e


def _attention_pair(names: tuple[str, str]):
    def build(shape, args, dtype, device):
        arms, e = al.build_arms(shape, args, dtype, device)
        return [a for a in arms if a.name in names], e
    return build


# --pair: (what differs, the arms' builder); the second arm is the one whose sites are listed
PAIRS = {"fp8": ("the layer install() builds, bf16 vs fp8 (hybrid, tensorwise)", _fp8_pair),
         "overlap": ("bf16, Megatron's linears (ours_attention) vs our overlapped linears (ours), "
                     "both with install()'s attention", _attention_pair(("ours_attention", "ours"))),
         "attention": ("bf16, Megatron's linears, the core attention a plain causal SDPA call "
                       "(sdpa_ref) vs install()'s (ours_attention)",
                       _attention_pair(("sdpa_ref", "ours_attention"))),
         "fp8_micro": ("fp8 at every forward vs at a step's later micro-batches under Megatron's "
                       "schedules (fp8_later_micro: its FP8 weights reused)", _micro_pair)}


def run_shape(shape: lc.LayerShape, args, dtype, device) -> dict:
    from megatron_overlap.ab.emulated_tp import MirrorTransport

    with lc.last_rank(shape, args, dtype, device, PAIRS[args.pair][1]) as (emu, arms, e):
        e = lc.Extras(e.grad, e.rope, None)  # causal from the mask type: SDPA without a mask tensor
        emu.use(MirrorTransport(emu.world, emu.rank), [a.layer for a in arms])
        ledgers = {a.name: record(a, e) for a in arms}
    first, second = ledgers
    row = {**lc.shape_row(shape), "tokens": shape.dims.seq_length * shape.dims.micro_batch, "arms": [first, second],
           "totals": {n: totals(ops, args.bandwidth, args.launch_us) for n, ops in ledgers.items()},
           "top_sites": sites(ledgers[second], args.top),
           "ops": {n: [asdict(o) for o in ops] for n, ops in ledgers.items()}}
    g = {n: row["totals"][n]["gemm"]["gflop"] for n in ledgers}
    row["check"] = {"passed": math.isclose(g[first], g[second], rel_tol=1e-9) and g[first] > 0,
                    "gemm_gflop": g, "what": "both arms run the same GEMMs (FLOPs equal)"}
    return row


def table(doc: dict) -> str:
    c = doc["config"]
    lines = [f"layer_ledger: one TransformerLayer fwd+bwd per TP rank, {PAIRS[c['pair']][0]}; predicted us "
             f"= MiB / {c['bandwidth']} TB/s + launches x {c['launch_us']} us (assumed)"]
    for r in doc["rows"]:
        a, b = r["arms"]
        lines.append(f"{r['shape']} ({r['tokens']} tokens): {'' if r['check']['passed'] else 'CHECK FAILED: '}"
                     f"{r['check']['what']}; {a} | {b}")
        lines.append(f"  {'class':12s} {'launches':>17s} {'MiB':>19s} {'GFLOP':>15s} {'predicted us':>19s}")
        ta, tb = r["totals"][a], r["totals"][b]
        us = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
        for cls in (*CLASSES, "rest"):
            lines.append(f"  {cls:12s} {ta[cls]['launches']:8d} {tb[cls]['launches']:8d} {ta[cls]['mib']:9.0f} "
                         f"{tb[cls]['mib']:9.0f} {ta[cls]['gflop']:7.0f} {tb[cls]['gflop']:7.0f} "
                         f"{us(ta[cls]['predicted_us']):>9s} {us(tb[cls]['predicted_us']):>9s}")
        lines.append(f"  {b}'s largest sites of the rest (MiB, launches):")
        for s in r["top_sites"]:
            lines.append(f"    {s['mib']:8.0f} {s['launches']:4d}  {s['phase']:8s} {s['class']:11s} "
                         f"{s['op']:22s} {s['site']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = al.arguments(__doc__, al.SHAPES)
    ap.add_argument("--pair", choices=sorted(PAIRS), default="fp8", help="which two arms (PAIRS)")
    ap.add_argument("--bandwidth", type=float, default=3.5, help="TB/s assumed for the memory-bound ops")
    ap.add_argument("--launch-us", type=float, default=2.0, help="us assumed per kernel (graphed)")
    ap.add_argument("--top", type=int, default=12)
    ap.set_defaults(device="cpu")
    args = ap.parse_args(argv)
    # 'all': the shapes of the benchmark whose arms the pair compares
    shapes = fp8_layer.SHAPES if args.pair.startswith("fp8") else tuple(al.SHAPES)
    return al.run(f"layer_ledger_{args.pair}", args, shapes, run_shape, table, torch.bfloat16)


if __name__ == "__main__":
    sys.exit(main())
