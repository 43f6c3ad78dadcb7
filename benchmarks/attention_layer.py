"""A whole transformer layer with the core attention install() gives it, against Megatron's
local layer and against the flash-attention reference, at one TP rank's dimensions on one
GPU, side by side in one run.

One process plays the last rank of a TP group (`ab.emulated_tp`, as benchmarks/
layer_compute.py does): a megatron-core TransformerLayer from the local spec (RMSNorm,
SwiGLU, GQA, RoPE, causal, no biases, sequence parallel), forward + backward. Arms, from
the same weights and input:
- megatron: Megatron's local layer: its linears, its DotProductAttention (the score matrix);
- sdpa_ref: the same with only its core attention replaced by a minimal causal SDPA call
  (`SDPAReference`, written here): the flash-attention reference;
- ours_attention: the same with only its core attention replaced by install()'s
  (`TorchDotProductAttention`; Megatron's linears): the attention's own cost in the layer;
- ours: the layer install() builds: our overlapped linears (the pass replay on) and
  `TorchDotProductAttention`; with --streams-arm N also ours_streamsN, the same with every
  overlapped layer's chunk GEMMs on N streams (Transformer Engine runs them on up to 3).
  On one GPU there is no communication for the overlap to hide, so against sdpa_ref it
  measures the overlapped linears' compute-side cost on top of the attention's.
Every arm's collectives and passes run on the mirror transport (layer_compute's
`timing_transport`: each GEMM gets a training step's data, each arm pays its collectives'
local copies). On a GPU no arm gets a mask tensor (the causal mask type says it;
Megatron's arm builds its own).

Measured: eager and graphed (layer_compute's `time_shape`: eager calls queued back to back,
the arms alternating call by call, as the graph replays do; medians of --repeat samples of
--reps calls per arm;
ratio = megatron ms / arm ms); memory per arm (`memory`: a steady-state step's peak, the
buffers the arm keeps once per process, its pass graphs' pool); before timing, every arm
against Megatron's on the mirror transport (output, input and parameter grads, max |diff|
/ max |megatron|: 2e-2 in bf16). Then the core attention alone (forward + backward,
graphed): each arm's, and ours on packed sequences (4 documents per sequence, THD) against
ours causal over the whole sequence.

    python benchmarks/attention_layer.py [--shapes all] [--reps 10] [--repeat 4]
    python benchmarks/attention_layer.py --ub-cfgs benchmarks/configs/ring_aggregate.yaml
    python benchmarks/attention_layer.py --shapes tiny --device cpu      # the check only
    python benchmarks/attention_layer.py --shapes 8b_tp4_s4096_b2 --layers 4  # a stack of 4
    python benchmarks/attention_layer.py --streams-arm 1 --repeat 5   # ours on 3 streams and on 1

--repeat: a multiple of the arms' count (4; 5 with --streams-arm) puts every arm's graph
capture at every position equally often (layer_compute's `time_shape`). --ub-cfgs: the
overlapped linears' settings (install()'s ub_cfgs; default TE's); the timing transport
cannot emulate a ring reduce-scatter, so a YAML that picks one for a row-parallel forward stops at the check.
--timeline: then one graphed replay of sdpa_ref and ours (and ours_wait) profiled (graph_timeline.py):
span, busy and GEMM time, each kernel group's time outside the GEMMs.

Writes <out>/attention_layer_<tag>.json and prints a table; exit status 2 when a check failed.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import statistics
import sys
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import graph_timeline as gt  # noqa: E402  (a graphed replay's timeline, --timeline)
import layer_compute as lc  # noqa: E402  (the layer set-up and timing of the linears' benchmark)
from megatron_overlap.cli_args import positive_int  # noqa: E402
from megatron_overlap.simulate.shapes import PRESETS, ModelDims  # noqa: E402

# name: (preset, TP, sequence, micro batch); the goals: ours / megatron, at least
SHAPES = {"70b_tp8_s4096_b2": ("70b", 8, 4096, 2), "8b_tp4_s4096_b2": ("8b", 4, 4096, 2),
          "70b_tp8_s16384_b1": ("70b", 8, 16384, 1)}
GOALS = {"70b_tp8_s4096_b2": 1.45, "8b_tp4_s4096_b2": 1.9, "70b_tp8_s16384_b1": 2.7}
GOAL_REF, GOAL_MEM = 0.97, 1.05  # within 3% of the reference's time, 5% of its memory
ARMS = ("megatron", "sdpa_ref", "ours_attention", "ours")  # ours last: attention_alone's packed case
DOCS = 4  # documents per packed sequence
TIMELINE_ARMS = ("sdpa_ref", "ours")  # each one graphed replay profiled (--timeline)


def arms_of(args) -> tuple[str, ...]:
    """The arms of a run: ARMS, with --streams-arm N an `ours_streamsN` and with --wait-arm
    an `ours_wait` before ours (which stays last)."""
    n = getattr(args, "streams_arm", None)
    extra = ((f"ours_streams{n}",) if n is not None else ()) + (
        ("ours_wait",) if getattr(args, "wait_arm", None) is not None else ())
    return (*ARMS[:-1], *extra, ARMS[-1])


def keyed_cfgs(ub_cfgs: str | None, key: str, value, methods: tuple[str, ...],
               layers: tuple[str, ...] = ()) -> dict:
    """`ub_cfgs` (TE's defaults for None) with `key` at `value` in every layer whose method
    is one of `methods` (and whose name is in `layers`, when given), as a ub_cfgs mapping
    install() reads; the other layers as given (a key they cannot take is refused)."""
    from megatron_overlap.config.loading import parse, read_source

    raw = dict(read_source(ub_cfgs))
    settings, _ = parse(raw, rs_dgrad=False)  # (refuses a bad source here, naming it)
    return {**raw, **{name: {**(raw.get(name) or {}), key: value}
                      for name, s in settings.items()
                      if s.method in methods and (not layers or name in layers)}}


def streams_cfgs(ub_cfgs: str | None, n: int) -> dict:
    """`ub_cfgs` with the chunk GEMMs of every layer that has them (a ring or a pipeline)
    on `n` streams (the `gemm_streams` key)."""
    return keyed_cfgs(ub_cfgs, "gemm_streams", n, ("ring_exchange", "pipeline"))


def wait_cfgs(ub_cfgs: str | None, layers: tuple[str, ...]) -> dict:
    """`ub_cfgs` with every ring all-gather in `layers` (every one for ()) running one
    waiting GEMM (the `wait_gemm` key)."""
    from megatron_overlap.config.names import LAYER_NAMES, is_reduce_scatter

    gathers = tuple(n for n in LAYER_NAMES if not is_reduce_scatter(n, "ring_exchange"))
    unknown = [n for n in layers if n not in gathers]
    if unknown:
        raise ValueError(f"--wait-arm: {unknown} are no all-gathers that can ring; "
                         f"choose from {list(gathers)}")
    return keyed_cfgs(ub_cfgs, "wait_gemm", True, ("ring_exchange",),
                      tuple(n for n in gathers if not layers or n in layers))


def gemm_streams_count(text: str) -> int:
    """--streams-arm's N: a stream count a layer's `gemm_streams` key takes (1..MAX)."""
    from megatron_overlap.config.names import MAX_GEMM_STREAMS

    n = positive_int(text)
    if n > MAX_GEMM_STREAMS:
        raise argparse.ArgumentTypeError(f"{n} streams: at most {MAX_GEMM_STREAMS}")
    return n


def shape_of(name: str, layers: int = 1) -> lc.LayerShape:
    """The per-rank shape `name`, `layers` transformer layers deep (--layers)."""
    if name == "tiny":
        return lc.LayerShape("tiny", "tiny", ModelDims(hidden=64, ffn_hidden=96, heads=8, query_groups=4,
                                                       seq_length=32, layers=layers, micro_batch=2), 2)
    preset, tp, seq, mb = SHAPES[name]
    return lc.LayerShape(name, preset.upper(), replace(PRESETS[preset], seq_length=seq, micro_batch=mb,
                                                      layers=layers), tp)


class Stack(torch.nn.Module):
    """`--layers` > 1: transformer layers run one after the other, called as one layer is
    (output, context), so every arm's step and memory window cover the whole stack. What
    an arm keeps once per process (its transport's workspaces, its pass graphs' pool) is
    then shared by the layers, as in a model."""

    def __init__(self, layers: list[torch.nn.Module]):
        super().__init__()
        self.layers = torch.nn.ModuleList(layers)

    @property
    def self_attention(self) -> torch.nn.Module:
        return self.layers[0].self_attention

    def forward(self, hidden_states, attention_mask=None, rotary_pos_emb=None):
        for layer in self.layers:
            hidden_states, _ = layer(hidden_states, attention_mask=attention_mask,
                                     rotary_pos_emb=rotary_pos_emb)
        return hidden_states, None


class SDPAReference(torch.nn.Module):
    """The flash-attention reference: causal SDPA on Megatron's [s, b, heads, dim] tensors,
    GQA through `enable_gqa`, nothing else (no mask tensor, no dropout, no packing)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **_):
        super().__init__()
        self.scale = 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query, key, value, attention_mask, **_):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)


def overlapped(arm: str) -> bool:
    """Whether `arm` runs our overlapped linears (ours, ours_streamsN, ours_wait)."""
    return arm in ("ours", "ours_wait") or arm.startswith("ours_streams")


def build(shape: lc.LayerShape, arm: str, dtype: torch.dtype, device: torch.device, fusions: str,
          ub_cfgs: str | None = None, wait_layers: tuple[str, ...] = ()):
    """One arm's layer (a `Stack` of `shape.dims.layers` of them, when more than one): built
    under install() (torch norms take SP in every arm), with Megatron's attention for
    megatron and sdpa_ref, ours for ours; `ub_cfgs`: install()'s (the overlapped linears'
    settings, which only the ours arms have: `ours_streamsN` on N streams, `streams_cfgs`;
    `ours_wait` with one waiting GEMM in the ring all-gathers of `wait_layers`, `wait_cfgs`)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    import megatron_overlap as mo

    if arm.startswith("ours_streams"):
        ub_cfgs = streams_cfgs(ub_cfgs, int(arm.removeprefix("ours_streams")))
    if arm == "ours_wait":
        ub_cfgs = wait_cfgs(ub_cfgs, wait_layers)
    mo.install(ub_cfgs, backend="torch_p2p", attention="torch" if arm.startswith("ours") else "megatron")
    try:
        spec = get_gpt_layer_local_spec(normalization="RMSNorm")
        if arm == "sdpa_ref":
            spec.submodules.self_attention.submodules.core_attention = SDPAReference
        config = lc.layer_config(shape, overlapped(arm), dtype, device, fusions)
        layers = [build_module(spec, config=config, layer_number=i + 1) for i in range(shape.dims.layers)]
    finally:
        mo.uninstall()
    layer = layers[0] if len(layers) == 1 else Stack(layers)
    return layer.to(device=device, dtype=dtype).train()


def build_arms(shape: lc.LayerShape, args, dtype, device):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    d = shape.dims
    names = arms_of(args)
    layers = {a: build(shape, a, dtype, device, args.fusions, args.ub_cfgs,
                       tuple(getattr(args, "wait_arm", None) or ())) for a in names}
    for a in names[1:]:
        got = layers[a].load_state_dict(layers["megatron"].state_dict(), strict=True)
        assert not got.missing_keys and not got.unexpected_keys, got
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(d.seq_length // shape.tp, d.micro_batch, d.hidden, generator=gen).to(device, dtype)
    g = torch.randn(x.shape, generator=gen).to(device, dtype)
    rope = RotaryEmbedding(kv_channels=d.hidden // d.heads, rotary_percent=1.0,
                           rotary_base=500000)(d.seq_length).to(device)
    arms = [lc.Arm(a, layers[a], x.clone().requires_grad_(True), True if overlapped(a) else None)
            for a in names]
    # no mask tensor on a GPU; on CPU Megatron's arm could not make its own (it makes it on
    # 'cuda'), so every arm gets the causal one there (the check's meaning is the same)
    mask = None if device.type == "cuda" else torch.ones(d.seq_length, d.seq_length).triu(1).bool()[None, None]
    return arms, lc.Extras(g, rope, mask)


def check(emu, arms, e, tol: float, follow_reference: bool) -> dict:
    """Every arm against Megatron's on the mirror transport (layer_compute's measure):
    within `tol`; with `follow_reference` (bf16), or, per output and gradient, within 5% of
    the flash reference's own distance from Megatron's, the reference itself within
    2.5 x `tol` (the same function). At 16384 keys Megatron's bf16 softmax is that far from
    any fused kernel: 2.8e-2 for the reference too, on the H200 and the H100; the GPU tests
    hold each attention to fp32."""
    got = lc.mirrored_results(emu, arms, e)[0]
    errs = {a.name: {k: lc._rel(got[a.name][k], v) for k, v in got["megatron"].items()} for a in arms[1:]}
    worst = {a: max(e.values()) for a, e in errs.items()}
    ref = errs["sdpa_ref"]

    def near(a: str, k: str, v: float) -> bool:
        if v <= tol:
            return True
        if not follow_reference or ref[k] > 2.5 * tol:
            return False
        return a == "sdpa_ref" or v <= 1.05 * ref[k]
    ok = {a: all(near(a, k, v) for k, v in e.items()) for a, e in errs.items()}
    return {"tol_rel": tol, "max_rel_err": worst, "rel_err": errs,
            "within_reference": {a: worst[a] > tol and ok[a] for a in errs if a != "sdpa_ref"},
            "passed": all(ok.values())}


def memory(emu, arms, e, kind: str) -> dict:
    """Per arm, GiB: `kept`, what it holds after three steps beyond what was resident before
    them (the transport's workspaces, Megatron's global gather buffer: allocated once per
    process and shared by every layer); `step`, the peak of a steady-state step beyond that
    (activations and temporaries: per layer); `pools`, for an arm whose passes replay, the
    bytes the pass graphs' scratch pool reserves (`replay.pool_memory`: the process's, made
    at the first capture, perhaps before this window, and grown to the largest pass's scratch
    so far; what is allocated in it is not in `kept`); `first`, the peak of its first three
    steps. Peaks are allocated bytes, as torch.cuda.max_memory_allocated counts them; the
    caching allocator's fragmentation is not counted for any arm."""
    from megatron.core import parallel_state

    from megatron_overlap.overlap import replay

    out = {}
    for arm in arms:
        # each arm allocates its own once-per-process buffers inside the window: a fresh
        # transport (our workspaces), Megatron's global gather buffer emptied (its arms')
        emu.use(lc.timing_transport(emu, kind), [a.layer for a in arms])
        parallel_state.get_global_memory_buffer().buffer.clear()
        # the transport replaced may sit in a reference cycle: freed by a collection inside
        # the window, its workspaces would be subtracted from the new one's (kept read 0)
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        start, pool_start = torch.cuda.memory_allocated(), replay.pool_memory()[1]
        torch.cuda.reset_peak_memory_stats()
        for _ in range(3):
            lc._zero_grads(arm)
            arm.step(e)
        lc._zero_grads(arm)
        torch.cuda.synchronize()
        first, held = torch.cuda.max_memory_allocated() - start, torch.cuda.memory_allocated()
        pool_held = replay.pool_memory()[1]
        kept = (held - pool_held) - (start - pool_start)
        torch.cuda.reset_peak_memory_stats()
        arm.step(e)
        lc._zero_grads(arm)
        torch.cuda.synchronize()
        step = torch.cuda.max_memory_allocated() - held
        pools = replay.pool_memory()[0] if arm.pass_replay else 0  # after the step: all of it
        g = 2 ** 30
        out[arm.name] = {"kept": kept / g, "step": step / g, "pools": pools / g,
                         "total": (kept + step + pools) / g, "first": first / g}
    return out


def attention_alone(shape: lc.LayerShape, arms, dtype, device, reps: int) -> dict:
    """Each arm's core attention alone, fwd+bwd graphed, ms; and ours on DOCS packed
    documents per sequence (THD) against ours causal over the whole sequence. The replays
    alternate (`time_interleaved`): timed one after the other, two arms running the same
    kernels differed by up to 8% (clock drift)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_overlap.tune.measure import graphed, time_interleaved

    d = shape.dims
    heads, groups, hd = d.heads // shape.tp, d.query_groups // shape.tp, d.hidden // d.heads
    s, b = d.seq_length, d.micro_batch
    gen = torch.Generator().manual_seed(3)
    mk = lambda *sh: torch.randn(*sh, generator=gen).to(device, dtype).requires_grad_(True)  # noqa: E731
    q, k, v = mk(s, b, heads, hd), mk(s, b, groups, hd), mk(s, b, groups, hd)
    dy = torch.randn(s, b, heads * hd, generator=gen).to(device, dtype)

    def fwd_bwd(fn, *ts):
        def step():
            for t in ts:
                t.grad = None
            out = fn()
            out.backward(dy.reshape(out.shape))
        return step
    replays = {}
    for arm in arms:
        core = arm.layer.self_attention.core_attention
        replays[arm.name] = graphed(fwd_bwd(lambda core=core: core(q, k, v, None), q, k, v))
    ours = arms[-1].layer.self_attention.core_attention
    t = s * b  # the batch's sequences back to back: b * DOCS documents in one pack
    qt, kt, vt = mk(t, heads, hd), mk(t, groups, hd), mk(t, groups, hd)
    cu = torch.arange(0, t + 1, s // DOCS, dtype=torch.int32, device=device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=s // DOCS, max_seqlen_kv=s // DOCS)
    step = fwd_bwd(lambda: ours(qt, kt, vt, None, packed_seq_params=params), qt, kt, vt)
    replays[f"ours_packed_{DOCS}_docs"] = graphed(step)
    out = time_interleaved(replays, reps)
    out["packed_ran"] = ", ".join(sorted(ours.ran))
    return out


def run_shape(shape: lc.LayerShape, args, dtype, device) -> dict:
    with lc.last_rank(shape, args, dtype, device, build_arms) as (emu, arms, extras):
        row = {**lc.shape_row(shape),
               "check": check(emu, arms, extras, 1e-5 if dtype == torch.float32 else 2e-2,
                              follow_reference=dtype != torch.float32),
               "attention": {a.name: type(a.layer.self_attention.core_attention).__name__ for a in arms}}
        if device.type == "cuda":
            row["memory_gib"] = memory(emu, arms, extras, args.timing)
            row["arms"] = lc.time_shape(emu, arms, extras, args, lc.timing_transport(emu, args.timing))
            row["attention_alone_ms"] = attention_alone(shape, arms, dtype, device, args.reps)
            row["goals"] = goals(shape.name, row)
            if args.timeline:
                row["timeline"] = gt.graph_timelines(
                    arms, extras, TIMELINE_ARMS + tuple(a.name for a in arms if a.name == "ours_wait"))
        else:
            row["skipped"] = "timing and memory: CPU (the check ran; times and peaks need a GPU)"
        row["wait_fell_back"] = wait_fell_back(arms)
        del arms
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def wait_fell_back(arms) -> list | None:
    """With a waiting arm (ours_wait, fp8_wait): every (pass, reason) for which the process
    ran the ring's chunk GEMMs in place of the waiting GEMM (none: the arm ran what it
    says); None without one."""
    from megatron_overlap.overlap import wait_gemm

    if not any(a.name.endswith("_wait") for a in arms):
        return None
    return sorted(map(list, wait_gemm.fell_back()))


def wait_lines(row: dict) -> list[str]:
    """The table's line on a waiting arm's fall-backs (none where it has none)."""
    fell = row.get("wait_fell_back")
    if not fell:
        return []
    return [f"{'':18s} wait_gemm fell back to chunk GEMMs: " + "; ".join(f"{p}: {why}" for p, why in fell)]


def goals(name: str, row: dict) -> dict:
    """Each goal with what was measured (graphed and eager times; peak memory)."""
    t, mem, alone = row["arms"], row["memory_gib"], row["attention_alone_ms"]
    ours = [a for a in t if a.startswith("ours")]
    out = {}
    for mode in ("graph", "eager"):
        ms = {a: v[f"{mode}_ms"] for a, v in t.items()}
        out[f"{mode}: ours vs megatron >= {GOALS.get(name, 0)}"] = (
            ms["megatron"] / ms["ours"], ms["megatron"] / ms["ours"] >= GOALS.get(name, 0))
        for a in ours:
            out[f"{mode}: {a} vs sdpa_ref >= {GOAL_REF}"] = (ms["sdpa_ref"] / ms[a], ms["sdpa_ref"] / ms[a] >= GOAL_REF)
    for a in ours:
        for part in ("step", "total"):
            r = mem[a][part] / mem["sdpa_ref"][part]
            out[f"memory ({part}): {a} / sdpa_ref <= {GOAL_MEM}"] = (r, r <= GOAL_MEM)
    packed = alone[f"ours_packed_{DOCS}_docs"] / alone["ours"]
    out[f"attention: ours packed ({DOCS} docs) / ours causal <= 1"] = (packed, packed <= 1.0)
    return out


def table(doc: dict) -> str:
    m = doc["meta"]
    n = doc["rows"][0]["dims"]["layers"] if doc["rows"] else 1
    what = "one TransformerLayer" if n == 1 else f"a stack of {n} TransformerLayers"
    lines = [f"attention_layer: {what} fwd+bwd per TP rank, {doc['dtype']}, "
             f"{m.get('gpu_name') or 'CPU'}, torch {m['torch']}, megatron-core {m.get('megatron_core')}, "
             f"{m['date']}; median of {doc['config']['repeat']} x {doc['config']['reps']} calls",
             f"{'shape':18s} {'arm':14s} {'eager ms':>9s} {'x meg':>6s} {'graph ms':>9s} {'x meg':>6s} "
             f"{'GiB step':>9s} {'kept':>6s} {'pools':>6s} {'attn ms':>8s}  check"]
    f = lambda v, p: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
    for r in doc["rows"]:
        c = r["check"]
        if "arms" not in r:
            lines.append(f"{r['shape']:18s} {'-':14s} check {'ok' if c['passed'] else 'FAIL'} "
                         f"(max rel {max(c['max_rel_err'].values()):.1e} <= {c['tol_rel']:g}); {r['skipped']}")
            continue
        for a in r["arms"]:
            t = r["arms"][a]
            err = c["max_rel_err"].get(a)
            lines.append(f"{r['shape']:18s} {a:14s} {f(t['eager_ms'], 2):>9s} {f(t['eager_ratio'], 2):>6s} "
                         f"{f(t['graph_ms'], 2):>9s} {f(t['graph_ratio'], 2):>6s} "
                         f"{f(r['memory_gib'][a]['step'], 3):>9s} {f(r['memory_gib'][a]['kept'], 3):>6s} "
                         f"{f(r['memory_gib'][a]['pools'], 3):>6s} "
                         f"{f(r['attention_alone_ms'][a], 2):>8s}  "
                         + ("" if err is None else f"rel {err:.1e}"
                            + (" (as the reference's)" if c["within_reference"].get(a) else "")))
        for a, t in r["arms"].items():
            if t.get("eager_passes"):
                p = t["eager_passes"]
                lines.append(f"{'':18s} {a}, eager: {p['replays']} of {p['calls']} pass calls replayed, "
                             f"{p['captures']} captured, {p['evictions']} graphs evicted")
        packed = r["attention_alone_ms"][f"ours_packed_{DOCS}_docs"]
        lines.append(f"{'':18s} ours, attention alone on {DOCS} packed documents per sequence: "
                     f"{packed:.2f} ms ({r['attention_alone_ms']['packed_ran']})")
        for goal, (value, met) in r["goals"].items():
            lines.append(f"{'':18s}   {goal}: {value:.3f} {'met' if met else 'NOT MET'}")
        lines += gt.timeline_lines(r.get("timeline")) + wait_lines(r)
    lines.append("x meg = megatron ms / arm ms, same mode. eager: calls queued back to back, arms alternating; graph: the "
                 "layer's fwd+bwd in one CUDA graph; every arm on the " + doc["config"]["timing"] + " transport. "
                 "GiB step: a steady-state step's peak beyond what the arm keeps; kept: buffers it "
                 "keeps (once per process); pools: its pass graphs' pool. "
                 "attn ms: the arm's core attention alone, fwd+bwd, graphed.")
    return "\n".join(lines)


def arguments(description: str, shapes, fusions: str = "off") -> argparse.ArgumentParser:
    """The command line of the one-GPU whole-layer benchmarks (this one, fp8_layer.py);
    `fusions`: the default of --fusions."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="all", help="all | comma list of " + ", ".join([*shapes, "tiny"]))
    layer_options(ap, fusions)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--out", default=os.path.join("benchmarks", "results"))
    ap.add_argument("--tag", default=None)
    return ap


def layer_options(ap: argparse.ArgumentParser, fusions: str = "off") -> None:
    """The options `build_arms` reads (--fusions, --ub-cfgs, --streams-arm), for every tool
    that builds this benchmark's arms (probe_layer_graph.py too)."""
    ap.add_argument("--fusions", choices=sorted(lc.FUSIONS), default=fusions,
                    help="the layer's elementwise fusions, every arm alike (layer_compute.FUSIONS): "
                         "off, or megatron_lm (Megatron-LM's defaults: its compiled SwiGLU and dropout-add)")
    ap.add_argument("--ub-cfgs", default=None,
                    help="TE-style overlap YAML for the layers install() builds (default: TE's defaults)")
    ap.add_argument("--streams-arm", type=gemm_streams_count, default=None, metavar="N",
                    help="one more arm, ours_streamsN: ours with every overlapped layer's chunk "
                         "GEMMs on N streams (the gemm_streams key), side by side with ours on "
                         "install()'s default")
    ap.add_argument("--wait-arm", nargs="*", default=None, metavar="LAYER",
                    help="one more arm, ours_wait: ours with the ring all-gathers named (all "
                         "of them when none is) running one GEMM that waits per block (the "
                         "wait_gemm key), side by side with ours")


def run(benchmark: str, args, shapes, run_shape, table, dtype: torch.dtype | None = None) -> int:
    """Each named shape through `run_shape(shape, args, dtype, device)`, the rows written to
    <out>/<benchmark>_<tag>.json and printed by `table`; exit status 2 when a check failed.
    `dtype`: the layers' (default bf16 on a GPU, fp32 on CPU)."""
    from megatron_overlap.ab.launch import plan_layout
    from megatron_overlap.ab.machine import machine_info
    from megatron_overlap.ab.results import write_json

    names = list(shapes) if args.shapes == "all" else args.shapes.split(",")
    bad = [n for n in names if n not in shapes and n != "tiny"]
    if bad:
        raise SystemExit(f"unknown shape(s) {bad}: use all or a comma list of {[*shapes, 'tiny']}")
    layout = plan_layout(1, args.device)
    device = torch.device("cpu") if layout.mode == "cpu" else torch.device("cuda", 0)
    dtype = dtype or (torch.float32 if device.type == "cpu" else torch.bfloat16)
    lc.init_process(device, args.seed)
    t0 = time.perf_counter()
    layers = getattr(args, "layers", 1)  # (attention_layer's --layers)
    rows = [run_shape(shape_of(n, layers), args, dtype, device) for n in names]
    meta = machine_info(layout, device)
    meta.update(note="one GPU, one process playing the last TP rank" if device.type == "cuda" else
                "CPU: FUNCTIONAL ONLY (the check ran, nothing was timed)", wall_s=time.perf_counter() - t0)
    doc = {"benchmark": benchmark, "command": " ".join([sys.executable, *sys.argv]),
           "config": vars(args), "dtype": str(dtype).removeprefix("torch."), "meta": meta, "rows": rows,
           "checks_passed": all(r["check"]["passed"] for r in rows)}
    path = os.path.join(args.out, f"{benchmark}_{args.tag or device.type}.json")
    write_json(path, doc)
    print(table(doc))
    print(f"results: {path}")
    return 0 if doc["checks_passed"] else 2


def main(argv=None) -> int:
    ap = arguments(__doc__, SHAPES)
    ap.add_argument("--timing", choices=("mirror", "null"), default="mirror",
                    help="the transport while timed and measured (timing_transport)")
    ap.add_argument("--layers", type=positive_int, default=1,
                    help="transformer layers per arm, run one after the other (Stack); the goals "
                         "are a single layer's")
    ap.add_argument("--timeline", action="store_true",
                    help="after timing, one graphed replay of sdpa_ref and ours profiled "
                         "(graph_timeline.py): each kernel group's time outside the GEMMs")
    return run("attention_layer", ap.parse_args(argv), SHAPES, run_shape, table)


if __name__ == "__main__":
    sys.exit(main())
