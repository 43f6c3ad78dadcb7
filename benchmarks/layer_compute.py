"""A whole transformer layer, compute side: one megatron-core TransformerLayer
(local spec, RMSNorm, SwiGLU, GQA, RoPE, causal core attention, no biases,
sequence parallel) at one TP rank's dimensions, forward + backward, ours against
Megatron's own plain TP layer, side by side in one run on one GPU.

One process plays the last rank of a TP group (`ab.emulated_tp`): Megatron builds
both layers at that TP size's per-rank dimensions, from the same weights. (The
last: under the causal mask its sequence shard attends to every other shard, so
the check below sees every block the all-gathers bring.)

- ours: `tp_comm_overlap=True` after `install()` (TE's default settings, or
  `--ub-cfgs`): the overlapped schedules' chunk GEMMs, copies, order and waits.
  Eager calls run as the layers run them on a replayable transport (each pass
  captured once and replayed); `ours_eager_passes` beside it turns that off.
- megatron: `tp_comm_overlap=False`, Megatron's ColumnParallelLinear /
  RowParallelLinear, their all-gathers and reduce-scatters handed to the same
  transport's collectives.

Both run on `MirrorTransport` (every emulated peer holds this rank's tensors:
all-gather tiles, reduce-scatter is TP x this rank's block): each GEMM gets the
data a training step gives it, and each arm pays the local copies its collectives
make (what a real transfer writes into this rank's memory). First, once, they must
give the same output, input grad and parameter grads (max |diff| / max |megatron|
per tensor: 1e-5 in float32, 2e-2 in bfloat16). `--timing null` times on `null`
instead (nothing moved or written), which compares unlike data (timing_transport).

Timed, arms interleaved (each repeat one round of a balanced design, `ab.timing.rotated`),
medians over --repeat:
- eager: fwd+bwd calls queued back to back, the arms alternating call by call in a
  serially balanced order (--reps per arm rounded up to whole cycles of it, one sync per
  cycle: `interleaved_samples`; device ms per call, host us to issue one, medians per
  repeat); how many of an overlapped arm's passes replayed meanwhile (`eager_passes`);
- graphed: fwd+bwd of the layer captured in one CUDA graph, replayed (device ms
  per replay; the arms' replays alternate call by call, each right after each other
  equally often, --reps rounded up to whole cycles of that order: time_interleaved; every
  repeat captures the arms' graphs anew in that repeat's order, so that over the repeats
  each arm is captured at each position). Not on CPU: CUDA graphs need a GPU.
ratio = megatron ms / ours ms (>1: ours faster).

    python benchmarks/layer_compute.py [--shapes all|70b_tp8,8b_tp4] [--reps 30] [--repeat 7]
    python benchmarks/layer_compute.py --shapes tiny --device cpu      # the check only, FUNCTIONAL

Writes <out>/layer_compute_<tag>.json (every sample, the checks, the machine) and
prints a table. Exit status 2 when a check failed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\..*")

HERE = os.path.dirname(os.path.abspath(__file__))

from megatron_overlap.ab.compare import rel_error  # noqa: E402
from megatron_overlap.simulate.shapes import PRESETS, ModelDims  # noqa: E402


@dataclass(frozen=True)
class LayerShape:
    name: str
    model: str
    dims: ModelDims
    tp: int


def layer_shapes(seq: int) -> dict[str, LayerShape]:
    """The Llama 3 presets (simulate.shapes) at the TP sizes of DESIGN.md's reference
    shapes, micro batch 1; `tiny` for CPUs."""
    at = lambda m: replace(PRESETS[m], seq_length=seq, micro_batch=1, layers=1)  # noqa: E731
    tiny = ModelDims(hidden=64, ffn_hidden=96, heads=8, query_groups=4, seq_length=32, layers=1)
    return {s.name: s for s in (LayerShape("70b_tp8", "70B", at("70b"), 8),
                                LayerShape("8b_tp4", "8B", at("8b"), 4),
                                LayerShape("tiny", "tiny", tiny, 4))}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="all",
                    help="all (70b_tp8,8b_tp4) | comma list of 70b_tp8, 8b_tp4, tiny")
    ap.add_argument("--seq", type=int, default=4096, help="tokens per micro batch of the 70b / 8b shapes")
    ap.add_argument("--reps", type=int, default=30, help="fwd+bwd calls per timed sample")
    ap.add_argument("--repeat", type=int, default=7, help="interleaved samples per arm; medians reported")
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                    help="default: bfloat16 on a GPU, float32 on CPU")
    ap.add_argument("--ub-cfgs", default=None, help="TE-style overlap YAML for ours (default: TE's defaults)")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"), help="directory")
    ap.add_argument("--tag", default=None, help="file name tag (default: gpu | cpu)")
    ap.add_argument("--timing", choices=("mirror", "null"), default="mirror",
                    help="the transport while timed (timing_transport)")
    return ap.parse_args(argv)


def pick_shapes(spec: str, seq: int) -> list[LayerShape]:
    known = layer_shapes(seq)
    names = ["70b_tp8", "8b_tp4"] if spec in ("", "all") else [s.strip() for s in spec.split(",")]
    bad = [n for n in names if n not in known]
    if bad:
        raise SystemExit(f"unknown shape(s) {bad}: use all or a comma list of {sorted(known)}")
    return [known[n] for n in names]


# -- set-up ---------------------------------------------------------------------------------
def init_process(device: torch.device, seed: int) -> None:
    """A world of one process (gloo: nothing is ever sent) and Megatron's parallel
    state at TP 1, which `EmulatedTP` then turns into a TP group of its size."""
    from megatron.core import parallel_state

    if device.type == "cpu":  # megatron-core on CPU: the test suite's shims (never in the library)
        sys.path.insert(0, os.path.join(HERE, "..", "tests"))
        from helpers.megatron_cpu import install_cpu_shims

        install_cpu_shims()
    else:
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    torch.manual_seed(seed)


@contextlib.contextmanager
def last_rank(shape: LayerShape, args, dtype: torch.dtype, device: torch.device, build):
    """(emulation, arms, extras) of one shape, as every whole-layer benchmark sets it up:
    this process the last rank of an emulated TP group (`ab.emulated_tp`), Megatron's RNG
    seeded for it, the arms made by `build(shape, args, dtype, device)`."""
    from megatron_overlap.ab.emulated_tp import EmulatedTP

    with EmulatedTP(shape.tp, rank=shape.tp - 1) as emu:
        seed_rng(device, args.seed)
        arms, extras = build(shape, args, dtype, device)
        yield emu, arms, extras


def shape_row(shape: LayerShape) -> dict:
    """The keys a whole-layer benchmark's result row starts with: which shape it is."""
    return {"shape": shape.name, "model": shape.model, "tp": shape.tp, "dims": shape.dims.__dict__}


def seed_rng(device: torch.device, seed: int) -> None:
    """Megatron's model-parallel RNG for this (emulated) TP rank."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.tensor_parallel import random as mrandom

    torch.manual_seed(seed)
    if device.type == "cuda":
        model_parallel_cuda_manual_seed(seed)
    else:
        mrandom.get_cuda_rng_tracker().reset()
        mrandom.get_cuda_rng_tracker().add("model-parallel-rng", seed + 2718)


# The elementwise fusions a layer runs with (`--fusions`). off: none, every elementwise op
# its own kernels. megatron_lm: what Megatron-LM's pretrain_gpt.py turns on by default for
# a SwiGLU model without Transformer Engine or apex: the SwiGLU (--swiglu sets
# bias_swiglu_fusion) and the dropout-add (bias_dropout_fusion), each through megatron-core's
# jit_fuser (torch.compile). Its RoPE fusion and gradient-accumulation fusion need
# Transformer Engine or apex, so they stay off in both.
FUSIONS = {"off": {}, "megatron_lm": dict(bias_activation_fusion=True, bias_dropout_fusion=True)}


def layer_config(shape: LayerShape, overlap: bool, dtype: torch.dtype, device: torch.device,
                 fusions: str = "off", **extra):
    """`fusions`: a key of FUSIONS; `extra`: more TransformerConfig fields
    (benchmarks/fp8_layer.py: Megatron's fp8 ones)."""
    from megatron.core.transformer import TransformerConfig

    d = shape.dims
    fields = dict(bias_dropout_fusion=False, bias_activation_fusion=False, masked_softmax_fusion=False,
                  apply_rope_fusion=False, gradient_accumulation_fusion=False)
    fields.update(FUSIONS[fusions], **extra)
    return TransformerConfig(
        num_layers=d.layers, hidden_size=d.hidden, ffn_hidden_size=d.ffn_hidden,
        num_attention_heads=d.heads, num_query_groups=d.query_groups,
        gated_linear_unit=d.swiglu, activation_func=F.silu, normalization="RMSNorm",
        add_bias_linear=False, tensor_model_parallel_size=shape.tp, sequence_parallel=True,
        tp_comm_overlap=overlap, params_dtype=dtype, bf16=dtype == torch.bfloat16,
        use_cpu_initialization=device.type == "cpu", hidden_dropout=0.0, attention_dropout=0.0,
        **fields)


def build_layer(shape: LayerShape, overlap: bool, dtype: torch.dtype, device: torch.device,
                fusions: str = "off", **extra):
    """One TransformerLayer from the local spec (ours where `overlap`: install() is active);
    `extra`: more config fields (layer_config)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    config = layer_config(shape, overlap, dtype, device, fusions, **extra)
    layer = build_module(get_gpt_layer_local_spec(normalization="RMSNorm"), config=config,
                         layer_number=1)
    return layer.to(device=device, dtype=dtype).train()


@dataclass(frozen=True)
class Extras:
    """What every call gets beside its input: the output grad, RoPE, the causal mask."""

    grad: torch.Tensor  # [s/tp, b, h]
    rope: torch.Tensor  # [s, 1, 1, head dim]
    mask: torch.Tensor  # [1, 1, s, s], True = masked (given, so no arm builds it per call)


@dataclass
class Arm:
    name: str
    layer: torch.nn.Module
    x: torch.Tensor  # the layer's input shard [s/tp, b, h], a leaf
    pass_replay: bool | None = None  # ours: pass replay forced on / off; None: Megatron's arm

    def step(self, e: Extras) -> torch.Tensor:
        """One forward and backward; returns the output."""
        from megatron_overlap.overlap import replay

        before = replay.set_enabled(self.pass_replay) if self.pass_replay is not None else None
        try:
            out, _ = self.layer(self.x, attention_mask=e.mask, rotary_pos_emb=e.rope)
            out.backward(e.grad)
        finally:
            if self.pass_replay is not None:
                replay.set_enabled(before)
        return out


def build_arms(shape: LayerShape, args, dtype: torch.dtype, device: torch.device):
    """(arms, extras): Megatron's layer, ours from its weights, every arm on its own
    copy of one input."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    d = shape.dims
    plain = build_layer(shape, False, dtype, device)
    ours = build_layer(shape, True, dtype, device)
    missing = ours.load_state_dict(plain.state_dict(), strict=True)
    assert not missing.missing_keys and not missing.unexpected_keys, missing
    if d.seq_length % shape.tp:
        raise SystemExit(f"{shape.name}: sequence {d.seq_length} does not split over TP={shape.tp}")
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    x = torch.randn(d.seq_length // shape.tp, d.micro_batch, d.hidden, generator=gen).to(device, dtype)
    g = torch.randn(x.shape, generator=gen).to(device, dtype)
    rope = RotaryEmbedding(kv_channels=d.hidden // d.heads, rotary_percent=1.0,
                           rotary_base=500000)(d.seq_length).to(device)
    mask = torch.triu(torch.ones(d.seq_length, d.seq_length, dtype=torch.bool, device=device),
                      diagonal=1)[None, None]
    leaf = lambda: x.clone().requires_grad_(True)  # noqa: E731
    arms = [Arm("megatron", plain, leaf()), Arm("ours", ours, leaf(), True)]
    if device.type == "cuda":  # pass replay acts on GPUs only
        arms.append(Arm("ours_eager_passes", ours, leaf(), False))
    return arms, Extras(g, rope, mask)


# -- the check ------------------------------------------------------------------------------
def _zero_grads(arm: Arm) -> None:
    arm.x.grad = None
    for p in arm.layer.parameters():
        p.grad = None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference over the largest value, in fp32."""
    return rel_error(a, b, "max", torch.float32)


def mirrored_results(emu, arms: list[Arm], e: Extras, mirror=None
                     ) -> tuple[dict[str, dict[str, torch.Tensor]], dict[str, dict]]:
    """Each arm once on MirrorTransport from zero grads (the checks of this benchmark,
    attention_layer's and fp8_layer's): per arm its output, input grad and every
    parameter grad, and the transfers it started there, per op. `mirror`: the transport
    class (MirrorTransport; a test hands in a broken one)."""
    from megatron_overlap.ab.emulated_tp import MirrorTransport
    from megatron_overlap.comm import stats

    emu.use((mirror or MirrorTransport)(emu.world, emu.rank), [a.layer for a in arms])
    got, moved = {}, {}
    for arm in arms:
        _zero_grads(arm)
        stats.snapshot(reset=True)
        out = arm.step(e).detach()
        moved[arm.name] = {op: s["transfers"] for op, s in stats.snapshot(reset=True).items()}
        got[arm.name] = {"output": out, "input grad": arm.x.grad.detach().clone(),
                         **{f"grad {n}": p.grad.detach().clone()
                            for n, p in arm.layer.named_parameters()}}
        _zero_grads(arm)
    return got, moved


def check(emu, arms: list[Arm], e: Extras, tol: float, mirror=None) -> dict:
    """Both layers on MirrorTransport (`mirrored_results`): output, input grad and every
    parameter grad of ours against Megatron's (max |diff| / max |megatron|), and the
    transfers each arm started there."""
    got, moved = mirrored_results(emu, arms[:2], e, mirror)
    errs = {k: _rel(got["ours"][k], v) for k, v in got["megatron"].items()}
    worst = max(errs, key=errs.get)
    return {"transport": "mirror", "tol_rel": tol, "max_rel_err": errs[worst], "worst": worst,
            "rel_err": errs, "transfers": moved, "passed": all(e <= tol for e in errs.values())}


# -- timing ---------------------------------------------------------------------------------
def timing_transport(emu, kind: str):
    """The transport every arm's collectives and passes run on while timed and measured.
    `mirror` (default): every emulated peer holds this rank's tensors, so each GEMM gets
    data as in training; its copies stand for what a real transfer writes into this
    rank's memory, and every arm pays them. On `null` nothing is written into what a
    collective returns: Megatron's gathers then leave its buffers as first allocated
    (zeros, mostly) and its backward multiplies zeros, while ours reads null's random
    workspaces, and a GEMM on zeros runs up to ~20% faster on an H200 than on real
    values (less power, higher clocks): unlike data, a bias against ours."""
    from megatron_overlap.ab.emulated_tp import MirrorTransport
    from megatron_overlap.comm import NullTransport

    return (MirrorTransport if kind == "mirror" else NullTransport)(emu.world, emu.rank)


def time_shape(emu, arms: list[Arm], e: Extras, args, transport=None, ref: str = "megatron") -> dict:
    """Eager back to back and graphed, arms interleaved; per arm every sample; ratios
    against arm `ref`. Every arm's collectives and passes on `transport` (default: a
    fresh `null`)."""
    from megatron_overlap.ab.timing import rotated
    from megatron_overlap.comm import NullTransport
    from megatron_overlap.overlap import replay
    from megatron_overlap.tune.measure import graphed, interleaved_samples, time_interleaved

    emu.use(transport or NullTransport(emu.world, emu.rank), [a.layer for a in arms])
    fns = {a.name: (lambda a=a: a.step(e)) for a in arms}
    for fn in fns.values():  # warm-up: buffers sized, pass graphs captured, kernels chosen
        for _ in range(3):
            fn()
    samples = {n: {"eager_ms": [], "host_us": [], "graph_ms": []} for n in fns}
    passes = {n: dict.fromkeys(replay.totals(), 0) for n in fns}  # pass replays while eager

    def counted(n: str):
        def call():
            before = replay.totals()
            fns[n]()
            for k, v in replay.totals().items():
                passes[n][k] += v - before[k]
        return call

    # eager first, then graphed: the graphs' pools (each keeps its step's activations) and
    # an eager step's activations are never held together (70B at 16384 tokens: Megatron's
    # arm needs ~33 GiB for each, which an 80 GiB card cannot hold beside the other arms').
    # Eager calls alternate arm by arm, queued back to back (one sync per cycle of them), so
    # that clock and power drift hit every arm alike: timed in blocks of one arm, the same arm
    # spread ~10% from block to block at 70B, more than the goals' 3%
    for rep in range(args.repeat):
        eager = interleaved_samples({n: counted(n) for n in fns}, args.reps, queued=True)
        for n, (dev, host) in eager.items():
            samples[n]["eager_ms"].append(statistics.median(dev))
            samples[n]["host_us"].append(statistics.median(host))
    graph_errors: dict[str, str] = {}
    for rep in range(args.repeat):
        # every repeat captures the graphs anew, in the rotated order: at 70B with 16384
        # tokens the arm captured second (after Megatron's ~33 GiB pool) replayed ~3% faster
        # than the one captured third, whichever arm it was, with the same kernels
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        graphs = {}
        for n in rotated(list(fns), rep):
            if n == "ours_eager_passes" or n in graph_errors:  # graphed, it is "ours"
                continue
            try:
                graphs[n] = graphed(fns[n])
            except Exception as exc:  # keep the eager figures; say why the column is empty
                graph_errors[n] = f"{type(exc).__name__}: {exc}"
                samples[n]["graph_ms"].clear()  # (earlier repeats' alone: not every position)
                torch.cuda.synchronize()
        if not graphs:
            break
        for n, ms in time_interleaved(graphs, args.reps).items():  # replays alternate call by call
            samples[n]["graph_ms"].append(ms)
        torch.cuda.synchronize()
        del graphs
    out = {}
    for n, s in samples.items():
        med = {k: statistics.median(v) if v else None for k, v in s.items()}
        out[n] = {**med, "samples": s, "graph_error": graph_errors.get(n)}
        if passes[n]["calls"]:  # an overlapped arm: did its eager passes replay?
            out[n]["eager_passes"] = passes[n]
    ref = out[ref]
    for n, r in out.items():
        for mode in ("eager", "graph"):
            a, b = ref[f"{mode}_ms"], r[f"{mode}_ms"]
            r[f"{mode}_ratio"] = a / b if a and b else None
            # per repeat (the arms of one repeat, in one mode, ran next to each other)
            pairs = zip(ref["samples"][f"{mode}_ms"], r["samples"][f"{mode}_ms"])
            ratios = [x / y for x, y in pairs]
            r[f"{mode}_ratio_range"] = (min(ratios), max(ratios)) if ratios else None
    return out


def flops(shape: LayerShape) -> float:
    """Per-rank GEMM FLOPs of one forward + backward of the four TP linears (3x forward)."""
    d = shape.dims
    return 3 * sum(2 * s.m * s.k * s.n for s in d.shapes(shape.model, shape.tp))


def run_shape(shape: LayerShape, args, dtype, device) -> dict:
    with last_rank(shape, args, dtype, device, build_arms) as (emu, arms, extras):
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        row = {**shape_row(shape),
               "per_rank_linears": [dict(buffer=s.buffer, m=s.m, k=s.k, n=s.n)
                                    for s in shape.dims.shapes(shape.model, shape.tp)],
               "linear_gflop_fwd_bwd": flops(shape) / 1e9,
               "check": check(emu, arms, extras, tol)}
        if device.type == "cuda":
            row["arms"] = time_shape(emu, arms, extras, args, timing_transport(emu, args.timing))
        else:
            row["skipped"] = "timing: CPU (the check ran; eager and CUDA-graph times need a GPU)"
        ours = arms[1].layer
        row["settings"] = [dict(settings=s.name, method=s.method, num_splits=s.splits(shape.tp),
                                aggregate=s.aggregate, gemm_streams=s.gemm_streams)
                           for m in ours.modules() if hasattr(m, "overlap_plan")
                           for s in (m.overlap_plan.fprop, m.overlap_plan.dgrad,
                                     m.overlap_plan.wgrad) if s is not None]
        del arms
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the next shape's layers start from a clean pool
    return row


# -- output ---------------------------------------------------------------------------------
def _table(doc: dict) -> str:
    m = doc["meta"]
    lines = [f"layer_compute: one TransformerLayer fwd+bwd per TP rank, {doc['dtype']}, "
             f"{m.get('gpu_name') or 'CPU'}, torch {m['torch']}, megatron-core "
             f"{m.get('megatron_core')}, {m['date']}; median of {doc['config']['repeat']} x "
             f"{doc['config']['reps']} calls"]
    head = (f"{'shape':8s} {'arm':18s} {'eager ms':>9s} {'host us':>8s} {'ratio':>6s} "
            f"{'graph ms':>9s} {'ratio':>6s}  check")
    lines.append(head)
    for r in doc["rows"]:
        c = r["check"]
        status = f"{'ok' if c['passed'] else 'FAIL'} (rel {c['max_rel_err']:.1e} <= {c['tol_rel']:g})"
        if "arms" not in r:
            lines.append(f"{r['shape']:8s} {'-':18s} {'-':>9s} {'-':>8s} {'-':>6s} {'-':>9s} "
                         f"{'-':>6s}  {status}; {r['skipped']}")
            continue
        for n, a in r["arms"].items():
            f = lambda v, p: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
            lines.append(f"{r['shape']:8s} {n:18s} {f(a['eager_ms'], 3):>9s} {f(a['host_us'], 0):>8s} "
                         f"{f(a['eager_ratio'], 3):>6s} {f(a['graph_ms'], 3):>9s} "
                         f"{f(a['graph_ratio'], 3):>6s}  {status if n == 'ours' else ''}")
            if a["graph_error"]:
                lines.append(f"{'':8s} {n}: the CUDA-graph capture failed: {a['graph_error'][:300]}")
    lines.append("ratio = megatron ms / arm ms, same mode (goal: ours >= 0.97). eager: calls queued "
                 "back to back, arms alternating; graph: fwd+bwd in one CUDA graph, replayed. Both arms "
                 f"on the {doc['config'].get('timing', 'null')} transport; check: outputs and grads on the "
                 "mirror transport.")
    return "\n".join(lines)


def main(argv=None) -> int:
    from megatron_overlap.ab.launch import plan_layout
    from megatron_overlap.ab.machine import machine_info
    from megatron_overlap.ab.results import write_json

    args = parse_args(argv)
    layout = plan_layout(1, args.device)
    device = torch.device("cpu") if layout.mode == "cpu" else torch.device("cuda", 0)
    dtype = getattr(torch, args.dtype or ("float32" if device.type == "cpu" else "bfloat16"))
    shapes = pick_shapes(args.shapes, args.seq)
    init_process(device, args.seed)
    import megatron_overlap as mo

    mo.install(ub_cfgs=args.ub_cfgs, backend="torch_p2p")  # ours' transport is replaced by null
    t0 = time.perf_counter()
    try:
        rows = [run_shape(s, args, dtype, device) for s in shapes]
    finally:
        mo.uninstall()
    meta = machine_info(layout, device)
    meta.update(ranks=1, dist_backend="none (one process emulating a TP rank)",
                note=("one GPU, one process playing the last TP rank" if device.type == "cuda" else
                      "CPU: FUNCTIONAL ONLY (the check ran, nothing was timed)"),
                cuda_device_max_connections=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"),
                wall_s=time.perf_counter() - t0)
    doc = {"benchmark": "layer_compute", "command": " ".join([sys.executable, *sys.argv]),
           "config": vars(args), "dtype": str(dtype).removeprefix("torch."), "meta": meta,
           "rows": rows, "checks_passed": all(r["check"]["passed"] for r in rows)}
    tag = args.tag or ("gpu" if device.type == "cuda" else "cpu")
    path = os.path.join(args.out, f"layer_compute_{tag}.json")
    write_json(path, doc)
    print(_table(doc))
    print(f"results: {path}")
    if not doc["checks_passed"]:
        print("CHECK FAILED: ours and Megatron's layer differ on the mirror transport")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
