"""The vocabulary of a TP-overlap config and Transformer Engine's defaults for it.

Everything here mirrors ``initialize_ub`` in Transformer Engine's
``transformer_engine/pytorch/module/base.py`` (its ``methods`` table,
``layers_all_gather_overlap`` / ``layers_reduce_scatter_overlap`` lists, the
AG/RS pairs and ``get_default_config``), so that a TE ``ub_cfgs`` file means
the same thing here; one default differs, `aggregate`'s (AGGREGATE_AUTO). Pure data and
rules: no torch.
"""

from __future__ import annotations

from typing import Any

# Megatron's tp_comm_buffer_name of each TP linear of a transformer layer, by kind.
COLUMN_BUFFERS: tuple[str, ...] = ("qkv", "fc1")  # ColumnParallelLinear
ROW_BUFFERS: tuple[str, ...] = ("proj", "fc2")  # RowParallelLinear
BUFFER_NAMES: tuple[str, ...] = ("qkv", "proj", "fc1", "fc2")  # in layer order
PASSES: tuple[str, ...] = ("fprop", "dgrad", "wgrad")
# TE's ub_cfgs layer names: qkv_fprop, qkv_dgrad, qkv_wgrad, proj_fprop, ...
LAYER_NAMES: tuple[str, ...] = tuple(f"{b}_{p}" for b in BUFFER_NAMES for p in PASSES)
METHODS: tuple[str, ...] = ("ring_exchange", "pipeline", "bulk", "external")
# The FP8 GEMMs that accumulate fast (torch._scaled_mm's use_fast_accum: on Hopper the tensor
# cores' own accumulator, not promoted to fp32 as the sum goes: faster, less exact), by
# install(fp8_fast_accum=)'s value. "fprop" is what Transformer Engine's recipes (the
# forward GEMM without split accumulation) and torchao's Float8Linear run by default
FAST_ACCUMS: dict[str, tuple[str, ...]] = {"fprop": ("fprop",), "none": (), "all": PASSES}
FAST_ACCUM_DEFAULT = "fprop"


def fast_accum_label(gemms: tuple[str, ...]) -> str:
    """How a precision names the FP8 GEMMs that accumulate fast."""
    return f"fast accumulation: {', '.join(gemms) or 'none'}"

# TE's ub_cfgs keys, in the order they are written out, then ours (EXTENSION_KEYS).
TE_KEYS: tuple[str, ...] = (
    "method", "num_sm", "cga_size", "set_sm_margin", "num_splits", "atomic_gemm", "use_ce",
    "aggregate", "fp8_buf", "comm_priority", "gemm_priority", "pipeline_rs_overlap_first_gemm",
)
# Keys TE does not have. TE's add_ub() takes its keys as keyword arguments and would
# refuse these, so they are written out only when not at their default.
EXTENSION_KEYS: tuple[str, ...] = ("ring_order", "gemm_streams", "wait_gemm")
KEYS: tuple[str, ...] = TE_KEYS + EXTENSION_KEYS
EXTENSION_DEFAULTS: dict[str, object] = {"ring_order": "auto", "gemm_streams": 0,
                                         "wait_gemm": False}
# wait_gemm: a ring all-gather's GEMM as one kernel over the whole gathered input whose
# tiles wait for their block (overlap.wait_gemm), in place of a GEMM per block
# gemm_streams: CUDA streams the chunk GEMMs round-robin over (2 fills the wave-quantization
# gap of one chunk's last wave with the next chunk's first); 0: the global default
# (install(gemm_streams=...), else MEGATRON_OVERLAP_GEMM_STREAMS, else DEFAULT_GEMM_STREAMS).
MAX_GEMM_STREAMS = 8
# Transformer Engine runs a ring's or pipeline's chunk GEMMs round-robin over up to 3
# compute streams; side by side with one, graphed, 3 were faster at the 4096-token layers
# and mixed at 16384 tokens (docs/results.md#three-gemm-streams-by-default)
DEFAULT_GEMM_STREAMS = 3
# ring_order: the ring's order over the TP group's nodes. auto: hierarchical when the
# group spans nodes; flat: rank order; hierarchical: inter-node transfers first.
RING_ORDERS: tuple[str, ...] = ("auto", "flat", "hierarchical")
# `aggregate`: TE's key (true / false), and ours, "auto", the default where a file does not
# name it: a ring all-gather runs TE's pairs where a block's GEMM outlasts the block's
# transfer, so the ring's transfers stay hidden either way and half the GEMMs, of twice the
# rows, fill the chip better; where the transfer outlasts the GEMM (the ring is
# copy-bound) the pairs' last GEMM, of two blocks, would lengthen the exposed tail. A
# block of `rows` x K takes 2 * rows * K * N FLOPs to multiply and rows * K * bytes to
# move, so the GEMM outlasts the transfer from N = bytes * FLOP/s / (2 * link bytes/s),
# whatever the rows and K: on Hopper (cuBLAS at ~0.82 of 989 dense bf16 TFLOP/s, ~360 GB/s
# copy-engine NVLink, simulate.hardware) ~2250, in FP8 the same (twice the FLOP/s, half
# the bytes). AGGREGATE_MIN_N leaves the chunk GEMMs' wave quantization a margin: from it
# on, the cost model favours the pairs at every row count, K and even TP > 2 its sweep
# tries (tests/test_simulate.py). Resolved per layer when it is built
# (`LayerSettings.aggregates`), and said in its settings row.
AGGREGATE_AUTO = "auto"
AGGREGATE_MIN_N = 3584
# Keys TE's add_ub() also takes from ub_cfgs (documented in initialize_ub's docstring) but that
# are derived here from the layer and its method; accepted only when they agree.
DERIVED_KEYS: tuple[str, ...] = ("is_reduce_scatter",)

# TE's `methods` table: the method each layer gets when ub_cfgs does not name one.
DEFAULT_METHODS: dict[str, str] = {
    "qkv_fprop": "ring_exchange", "fc1_fprop": "ring_exchange",
    "proj_dgrad": "ring_exchange", "fc2_dgrad": "ring_exchange",
    "proj_fprop": "pipeline", "fc2_fprop": "pipeline",
    "qkv_dgrad": "bulk", "qkv_wgrad": "bulk", "fc1_dgrad": "bulk", "fc1_wgrad": "bulk",
    "proj_wgrad": "external", "fc2_wgrad": "external",
}

# TE's layers_reduce_scatter_overlap (before the rs-dgrad switch); every other layer
# all-gathers (TE's layers_all_gather_overlap).
REDUCE_SCATTER_LAYERS = frozenset({"proj_fprop", "fc2_fprop", "qkv_wgrad", "fc1_wgrad"})
# TE's dgrad_reduce_scatter_overlap: a non-bulk method turns these into GEMM+RS overlaps and
# leaves their wgrad partner unused.
RS_DGRAD_LAYERS: tuple[str, ...] = ("qkv_dgrad", "fc1_dgrad")
BULK_LAYERS = frozenset({"qkv_dgrad", "qkv_wgrad", "fc1_dgrad", "fc1_wgrad"})
# What `bulk` means on those passes (the settings table, the layers' rows, wandb): one
# whole collective started before a GEMM that does not need its result and waited on
# after it, i.e. hidden under another GEMM; never "no overlap" (the schedules' own `bulk`,
# which the per-layer benchmark arms run, is that: the whole transfer, then the GEMM).
BULK_HIDES: dict[str, str] = {
    "dgrad": "the saved input's all-gather (for the wgrad) runs whole under the dgrad GEMM",
    "wgrad": "the dgrad's reduce-scatter (all-reduce without sequence parallelism) runs "
             "whole under the wgrad GEMM",
}
# TE's ag_rs_pairs: AG and RS halves of one TP block (atomic ring-exchange must match).
AG_RS_PAIRS: dict[str, str] = {"qkv_fprop": "proj_fprop", "fc1_fprop": "fc2_fprop"}
# TE's external_gemm_to_overlap: these wgrads all-gather on their dgrad's ring-exchange streams.
EXTERNAL_PAIRS: dict[str, str] = {"proj_wgrad": "proj_dgrad", "fc2_wgrad": "fc2_dgrad"}

TE_PIPELINE_SPLITS = 4  # get_default_config's num_splits for every non-ring method
MAX_CGA_SIZE = 8  # CUDA's portable thread-block-cluster limit; TE passes cga_size through


def is_reduce_scatter(name: str, method: str) -> bool:
    """TE's AG/RS classification: fixed per layer, except that a dgrad in
    RS_DGRAD_LAYERS reduce-scatters as soon as its method is not bulk."""
    if name in RS_DGRAD_LAYERS:
        return method != "bulk"
    return name in REDUCE_SCATTER_LAYERS


def wgrad_of(dgrad: str) -> str:
    return dgrad.replace("dgrad", "wgrad")


def te_defaults(name: str, method: str | None = None) -> dict[str, Any]:
    """get_default_config() for one layer, keyed by the method the layer ends up with.

    One key differs: `aggregate` is "auto" (AGGREGATE_AUTO), where TE's is false.

    comm_priority / gemm_priority are 0: TE asks CUDA for the stream-priority range
    (comm highest, GEMM lowest), and TE's C++ CommOverlapCore treats 0/0 as exactly that
    request, so 0/0 is "TE's default" without querying a device here.
    """
    method = method or DEFAULT_METHODS[name]
    ring = method == "ring_exchange"
    return {
        "method": method,
        "num_sm": 1 if ring else 16,
        "cga_size": 1 if ring else 2,
        "set_sm_margin": not ring,
        "num_splits": None if ring else TE_PIPELINE_SPLITS,  # None: TP size
        "atomic_gemm": False,
        "use_ce": True,
        "aggregate": AGGREGATE_AUTO,
        "fp8_buf": not is_reduce_scatter(name, method),
        "comm_priority": 0,
        "gemm_priority": 0,
        "pipeline_rs_overlap_first_gemm": False,
        **EXTENSION_DEFAULTS,
    }
