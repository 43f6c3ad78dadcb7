"""The SCRIPT that tests/test_megatron_lm.py runs through the entry point,
`python tests/helpers/megatron_lm_cpu.py tests/helpers/megatron_lm_probe.py MODE [ARGS]`,
with a Megatron-LM tree first on PYTHONPATH. It calls that tree's own functions the
way its pretrain_gpt.py does, on CPU, and prints one `PROBE-RESULT {json}` line.

MODE args: one process; parsing, validation and the TP-communicator hook for several
flag sets (megatron_overlap.install is recorded, not run).
MODE model: one gloo rank of several (env RANK, WORLD_SIZE, MASTER_*); ARGS are
Megatron-LM's. Megatron's initialize_megatron (CPU shims; its C++/CUDA build step
skipped), then the GPT model through pretrain_gpt's model_provider, then a forward
and backward on fixed tokens.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(1, os.path.dirname(HERE))  # tests/, for helpers.*

from megatron.training import arguments, global_vars, initialize  # noqa: E402

import megatron_overlap  # noqa: E402
from megatron_overlap.megatron_lm import hooks  # noqa: E402

DEFAULTS = {"tokenizer_type": "GPT2BPETokenizer"}
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
        "--global-batch-size", "1", "--lr", "1e-4", "--train-iters", "1",
        "--tensor-model-parallel-size", "2", "--tokenizer-type", "NullTokenizer",
        "--vocab-size", "128", "--mock-data"]
OURS = ["--tp-comm-overlap", "--tp-comm-overlap-impl", "megatron_overlap",
        "--tp-comm-overlap-cfg", "x.yaml", "--sequence-parallel", "--transformer-impl", "local"]


HELP_LINES = ("--tp-comm-overlap-impl {te,megatron_overlap}",
              "--tp-comm-overlap-backend {auto,torch_p2p,symm,nvshmem}", "--tp-comm-overlap-cfg")


class Recorder:
    """megatron_overlap.install replaced by one that records its keywords (and runs
    the real one when `run` is set)."""

    def __init__(self, run: bool):
        self.calls: list[dict] = []
        self.run, self.real = run, megatron_overlap.install

    def __enter__(self):
        def install(**kwargs):
            self.calls.append(kwargs)
            return self.real(**kwargs) if self.run else None
        megatron_overlap.install = install
        return self

    def __exit__(self, *exc):
        megatron_overlap.install = self.real


def _parse_fn():
    """parse_args as this version's start-up binds it (initialize's own import up to
    core_v0.17, arguments' in core_v0.18+)."""
    return getattr(initialize, "parse_args", None) or arguments.parse_args


def _validate_fn():
    return getattr(initialize, "validate_args", None) or arguments.validate_args


def parse(*argv: str):
    sys.argv = ["pretrain_gpt.py", *argv]
    return _parse_fn()()


def validate(args) -> str | None:
    try:
        _validate_fn()(args, DEFAULTS)
        return None
    except (AssertionError, ValueError) as e:
        return f"{type(e).__name__}: {e}"


def tp_init(args) -> dict:
    global_vars._GLOBAL_ARGS = None
    global_vars.set_args(args)
    with Recorder(run=False) as rec:
        try:
            initialize._initialize_tp_communicators()  # by the name initialize_megatron uses
            error = None
        except RuntimeError as e:
            error = str(e)
    return {"calls": rec.calls, "error": error, "te_imported": "transformer_engine" in sys.modules}


def help_text() -> dict:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            parse("--help")
        return {"ok": False, "error": "no SystemExit"}
    except SystemExit as e:
        text = out.getvalue()
        return {"ok": e.code == 0, "lists": [f for f in HELP_LINES if f in text],
                "chars": len(text)}
    except Exception as e:  # noqa: BLE001 - Megatron's own help may be broken (core_v0.18+)
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def probe_args() -> dict:
    os.environ.update(WORLD_SIZE="2", RANK="0", CUDA_DEVICE_MAX_CONNECTIONS="1")
    out: dict = {"version": hooks.megatron_core_version(), "arguments_file": arguments.__file__,
                 "hooked": {f"{m.__name__}.{t.name}": hasattr(getattr(m, t.name), "__wrapped__")
                            for m in (arguments, initialize) for t in hooks.TARGETS
                            if hasattr(m, t.name)}}
    a = parse(*BASE, *OURS)
    out["ours"] = {k: getattr(a, k) for k in ("tp_comm_overlap", "tp_comm_overlap_impl",
                   "tp_comm_overlap_cfg", "tp_comm_overlap_backend", "transformer_impl",
                   "sequence_parallel")}
    out["ours_valid"] = validate(a)
    out["ours_init"] = tp_init(a)
    b = parse(*BASE, *OURS, "--tp-comm-overlap-backend", "torch_p2p")
    b.tp_comm_overlap_cfg = None
    out["no_cfg_init"] = tp_init(b)
    out["with_te_layers"] = validate(parse(*BASE, *OURS[:-1], "transformer_engine"))
    out["no_sp"] = validate(parse(*BASE, *[x for x in OURS if x != "--sequence-parallel"]))
    # packed sequences (--sft): torch's attention runs them, Megatron's would refuse them
    out["sft_packs"] = hooks._sft_packs()
    out["sft_valid"] = validate(parse(*BASE, *OURS, "--sft"))
    out["sft_megatron_attention"] = validate(parse(*BASE, *OURS, "--sft",
                                                   "--megatron-overlap-attention", "megatron"))
    off = parse(*BASE, *OURS[1:3], "--sequence-parallel", "--transformer-impl", "local",
                "--tp-comm-overlap-backend", "torch_p2p")
    with Recorder(run=False) as rec:
        out["off_valid"] = validate(off)
    out["off_install"] = rec.calls
    d = parse(*BASE)
    out["default"] = [d.tp_comm_overlap, d.tp_comm_overlap_impl, d.tp_comm_overlap_backend,
                      d.tp_comm_overlap_cfg]
    d = parse(*BASE, "--tp-comm-overlap", "--sequence-parallel")
    out["te_valid"] = validate(d)
    out["te_init"] = tp_init(d)
    try:
        parse(*BASE, "--tp-comm-overlap-backend", "bogus")
        out["bogus_backend"] = "accepted"
    except SystemExit as e:
        out["bogus_backend"] = e.code
    out["help"] = help_text()
    hooks.uninstall_hooks()
    out["help_without_hooks"] = help_text()
    hooks.install_hooks()
    import argparse
    ours = hooks.add_arguments(argparse.ArgumentParser(add_help=False))
    out["our_help"] = ours.format_help()
    return out


def _packed_and_alone(model, tokens, labels, pos, cu) -> tuple[torch.Tensor, float]:
    """Per-token loss of `tokens` packed as Megatron-LM's get_batch hands a THD batch over
    (PackedSeqParams from cu_seqlens `cu`, positions `pos`, no mask), and the largest
    |difference| from each document run alone (padded to TP=2 (sequence parallelism) x 4
    (proj's pipeline chunks); causal, so the padding changes nothing before it). In eval
    mode: Megatron-LM's default dropouts (0.1) would draw differently in each run."""
    from megatron.core.packed_seq_params import PackedSeqParams

    longest = int((cu[1:] - cu[:-1]).max())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=longest, max_seqlen_kv=longest)
    training = model.training
    model.eval()
    with torch.no_grad():
        packed = model(tokens, pos, None, labels=labels, packed_seq_params=params).float()
        diff = 0.0
        for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
            pad = -(b - a) % 8
            t = torch.cat([tokens[:, a:b], tokens[:, :pad]], 1)
            y = torch.cat([labels[:, a:b], labels[:, :pad]], 1)
            alone = model(t, torch.arange(t.shape[1])[None], None, labels=y).float()[:, :b - a]
            diff = max(diff, float((packed[:, a:b] - alone).abs().max()))
    model.train(training)
    return packed, diff


def packed_vs_alone(model, args) -> dict:
    """The model the tree's model_provider built, fed a packed batch as Megatron-LM's SFT
    get_batch gives it (positions restarting per document): each token's loss against its
    document run alone."""
    lengths = [8, 16, 8]
    g = torch.Generator().manual_seed(11)
    tokens = torch.randint(0, args.padded_vocab_size, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    packed, diff = _packed_and_alone(model, tokens, torch.roll(tokens, -1, 1), pos, cu)
    ran = sorted({r for m in model.modules() for r in getattr(m, "ran", ())})
    return {"max_abs_diff": diff, "ran": ran, "shape": list(packed.shape)}


def sft_vs_alone(model, args) -> dict:
    """The tree's own --sft data (its SFTTokenizer with the prompt format, its SFTDataset
    packing conversations into a sequence with cu_seqlens, as pretrain_gpt builds them;
    benchmarks/sft_standins.py for the Hugging Face loaders) through the model that the
    tree's model_provider built, as get_batch hands it over: each token's loss against its
    conversation run alone."""
    import pretrain_gpt
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.training.datasets.sft_dataset import SFTDataset

    # as pretrain_gpt's train_valid_test_datasets_provider builds it, on every TP rank
    # (Megatron builds it on TP rank 0 and broadcasts the batch, which needs CUDA)
    config = pretrain_gpt.core_gpt_dataset_config_from_args(args)
    train = BlendedMegatronDatasetBuilder(SFTDataset, [2, 0, 0], lambda: True, config).build()[0]
    sample = train[0]
    if "cu_seqlens" not in sample:  # a tree whose SFT sequences are not packed (core_v0.14)
        return {"documents": 1, "tokens": int(sample["tokens"].numel())}
    tokens = sample["tokens"][None]
    cu = sample["cu_seqlens"].to(torch.int32)
    cu = cu[: int(torch.nonzero(torch.diff(cu)).max()) + 2] if cu.numel() > 2 else cu  # (padding entries)
    _, diff = _packed_and_alone(model, tokens, sample["labels"][None], sample["position_ids"][None], cu)
    mask = sample["loss_mask"]
    return {"documents": len(cu) - 1, "tokens": int(tokens.shape[1]), "max_abs_diff": diff,
            "loss_mask": [float(mask.min()), float(mask.max())],
            "tokenizer": type(global_vars.get_tokenizer()).__name__}


def probe_model() -> dict:
    from helpers.megatron_cpu import install_cpu_shims, rng_states_on_cpu
    from megatron.core.tensor_parallel import random as mrandom

    if "--sft" in sys.argv:  # Megatron-LM's own SFT data path, its HF loaders stood in for
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "benchmarks"))
        import sft_standins
        sft_standins.install()
    install_cpu_shims()
    if "--recompute-granularity" in sys.argv:  # Megatron's checkpoint saves a CUDA generator too
        rng_states_on_cpu()
    initialize._compile_dependencies = lambda *a, **k: None  # make/pybind11 helpers, CUDA kernels
    real_init_distributed = initialize._initialize_distributed

    def init_distributed(*a, **k):
        """Megatron builds its parallel groups only where it counts a GPU: count one
        and make set_device a no-op for the call (the CPU shims count none)."""
        count, set_device = torch.cuda.device_count, torch.cuda.set_device
        torch.cuda.device_count, torch.cuda.set_device = (lambda: 1), (lambda *_: None)
        try:
            return real_init_distributed(*a, **k)
        finally:
            torch.cuda.device_count, torch.cuda.set_device = count, set_device
    initialize._initialize_distributed = init_distributed
    with Recorder(run=True) as rec:
        if hasattr(arguments, "parse_and_validate_args"):  # core_v0.18+: pretrain_gpt parses
            arguments.parse_and_validate_args(args_defaults=DEFAULTS)
            initialize.initialize_megatron(allow_no_cuda=True)
        else:
            initialize.initialize_megatron(args_defaults=DEFAULTS, allow_no_cuda=True)
    args = global_vars.get_args()
    tracker = mrandom.get_cuda_rng_tracker()
    if "model-parallel-rng" not in tracker.get_states():  # _set_random_seed skips it without CUDA
        tracker.add("model-parallel-rng", args.seed + 2718)
    torch.manual_seed(args.seed)

    import pretrain_gpt  # the tree's own script, as a module (its __main__ block does not run)

    provider = pretrain_gpt.model_provider
    if "model_builder" in inspect.signature(provider).parameters:  # core_v0.16+
        import functools
        provider = functools.partial(provider, pretrain_gpt.gpt_builder)
    model = provider(pre_process=True, post_process=True)
    layers = model.decoder.layers
    linears = {name: [type(getattr(sub, name)).__name__ for sub in
                      [layer.self_attention if name in ("linear_qkv", "linear_proj") else layer.mlp
                       for layer in layers]]
               for name in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")}
    attention = [type(layer.self_attention.core_attention).__name__ for layer in layers]
    norms = {type(layers[0].input_layernorm).__name__:
             [bool(getattr(p, "sequence_parallel", False)) for p in layers[0].input_layernorm.parameters()]}

    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, args.padded_vocab_size, (args.micro_batch_size, args.seq_length), generator=g)
    labels = torch.roll(tokens, -1, dims=1)
    position_ids = torch.arange(args.seq_length).unsqueeze(0).expand_as(tokens)
    mask = torch.tril(torch.ones(1, 1, args.seq_length, args.seq_length)) < 0.5
    run = model
    if args.bf16:  # as Megatron-LM's get_model wraps it: inputs and outputs cast
        from megatron.core.transformer.module import Float16Module
        run = Float16Module(model.config, model)
    loss = run(tokens, position_ids, mask, labels=labels).float().mean()
    loss.backward()
    grad = sum(float(p.grad.float().norm()) for p in model.parameters() if p.grad is not None)
    from megatron_overlap.config import state

    now = state.current()
    precision = {n: m.precision.describe() for n, m in model.named_modules()
                 if hasattr(m, "precision")}  # our linears' (none on Megatron's)
    # (FP8 GEMMs take 16-token multiples: the documents below are shorter)
    fp8 = any("fp8" in p for p in precision.values())
    packed = packed_vs_alone(model, args) if "TorchDotProductAttention" in attention and not fp8 else None
    sft = sft_vs_alone(model, args) if getattr(args, "sft", False) else None
    return {"version": hooks.megatron_core_version(), "install": rec.calls, "linears": linears,
            "precision": precision,
            "attention": attention, "dataloader_masks": args.create_attention_mask_in_dataloader,
            "installed": {"backend": now.backend, "source": now.source,
                          "fc2_fprop_num_sm": now.settings["fc2_fprop"].num_sm},
            "norms": norms, "loss": loss.item(), "grad_norm_sum": grad, "packed": packed,
            "sft": sft,
            "te_imported": "transformer_engine" in sys.modules,
            "pretrain_gpt": pretrain_gpt.__file__, "megatron_core": sys.modules["megatron.core"].__file__}


if __name__ == "__main__":
    arguments.get_device_arch_version = lambda: 9  # validate_args asks the GPU (Hopper)
    mode = sys.argv.pop(1)
    result = probe_args() if mode == "args" else probe_model()
    print("PROBE-RESULT " + json.dumps(result), flush=True)
