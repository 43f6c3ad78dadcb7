"""Drop-in replacements for Megatron's ColumnParallelLinear / RowParallelLinear.

They *are* Megatron's classes (subclasses): same constructor, parameters,
attributes, state-dict and sharded-state-dict keys, so checkpoints move freely
between the two. Only the forward changes: the passes the layer's plan overlaps
run through `megatron_overlap.overlap`, frozen weights included (the backward then
skips the wgrad), and so does `gather_output`'s gather (and, in the backward, the
gather of a row layer's unsplit input): every wait bounded. A layer whose plan
overlaps nothing (or a case we leave to Megatron: MoE expert comm, deferred
embedding wgrad) runs Megatron's own forward.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Optional

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

from .. import comm
from ..comm.exchange import about
from ..config import state
from ..config.console import say_once
from ..overlap.fp8 import TAIL
from ..overlap.hierarchical import RingOrder
from ..overlap.replay import PassGraphs
from . import agree, checks
from .fp8 import DelayedScales, Fp8WeightCache
from .precision import layer_precision, enclosing_layer_number
from .graphs import megatron_graphs
from .functions import (ColumnParallelMatmul, GatherLastDim, RowParallelMatmul, ScatterLastDim,
                        token_rows)
from .plan import LayerPlan, build_plan, ring_order
from .wgrad import HAVE_APEX_WGRAD

@contextlib.contextmanager
def _without_fusion_check(config: Any):
    """Megatron refuses gradient_accumulation_fusion without apex; we have a torch
    fallback, so build the parent with the flag off and restore it."""
    fuse = getattr(config, "gradient_accumulation_fusion", False)
    if fuse and not HAVE_APEX_WGRAD:
        config.gradient_accumulation_fusion = False
    try:
        yield fuse
    finally:
        config.gradient_accumulation_fusion = fuse


class _OverlapMixin:
    """Plan and transport, chosen once at construction from install() state."""

    def _setup_overlap(self, kind: str, tp_comm_buffer_name: Optional[str], is_expert: bool,
                       name: Optional[str], fuse: bool) -> None:
        st = state.current()
        self.gradient_accumulation_fusion = fuse
        self.overlap_name = name
        self.tp_comm_buffer_name = tp_comm_buffer_name
        self.overlap_plan: LayerPlan = build_plan(
            self.config, tp_comm_buffer_name, kind, sequence_parallel=self.sequence_parallel,
            is_expert=is_expert, settings=st.settings, rs_dgrad_settings=st.rs_dgrad_settings,
            ring_n=(self.output_size_per_partition if kind == "column"
                    else self.input_size_per_partition), layer=name)
        self.overlap_backend = st.backend
        # bf16 or an FP8 recipe, from Megatron's own fp8 fields; refused here if it cannot run
        self.precision = layer_precision(self.config, self.overlap_plan.layer,
                                         enclosing_layer_number())
        if self.precision.fp8:
            checks.check_fp8_build(self)
        self._transport = None
        self._orders: dict[str, RingOrder] | None = None
        self._max_tokens = 0  # largest [sequence x batch] seen, across the TP group
        # each pass captured in a CUDA graph and replayed where it can be (overlap.replay),
        # unless Megatron graphs the layer itself (layers.graphs; refuses what cannot run);
        # an FP8 layer runs our path even without overlap (_use_megatron), so it counts too
        self.megatron_graphs = (megatron_graphs(self.config, self.overlap_plan.layer)
                                if self.overlap_plan.enabled or self.precision.fp8 else None)
        off = self.megatron_graphs and f"Megatron's CUDA graphs ({self.megatron_graphs}) capture it"
        self.pass_graphs = {p: PassGraphs(f"{self.overlap_plan.layer} {p}", off=off)
                            for p in ("fprop", "bwd")}
        # Megatron's schedules set it at each step's first micro-batch (set_is_first_microbatch,
        # for TE's FP8 parameter cache); the FP8 weight is then made once per step (tensorwise).
        # Not under Megatron's own CUDA graphs: a replay would not see the flag.
        self.is_first_microbatch = True
        self._fp8_cache = (Fp8WeightCache() if self.precision.recipe in ("tensorwise", "delayed")
                           and not getattr(self.config, "disable_parameter_transpose_cache", False)
                           and not self.megatron_graphs else None)
        # fp8_recipe 'delayed': the amax histories and scales, kept in the checkpoint
        self._fp8_delayed = (DelayedScales(self.precision) if self.precision.recipe == "delayed"
                             else None)
        if self.precision.dp_amax:
            say_once(logging.WARNING, "megatron_overlap: fp8_recipe='delayed' reduces each amax "
                     "over the TP group only; tp_only_amax_red=False also asks the data-parallel "
                     "ranks (Transformer Engine's default), which is not done here: each "
                     "data-parallel replica keeps its own histories (set tp_only_amax_red=True, "
                     "--tp-only-amax-red, to say so)")

    def get_extra_state(self) -> Optional[dict]:
        """The delayed-scaling histories (a checkpoint's `_extra_state`, as Transformer
        Engine keeps its FP8 metadata there); None otherwise, as Megatron's linears."""
        return None if self._fp8_delayed is None else self._fp8_delayed.state()

    def set_extra_state(self, state: Any) -> None:
        """Restore `get_extra_state()`. Another layer's state (None from Megatron's or a bf16
        layer, TE's metadata, a delayed state into a layer that does not scale so) is
        ignored, as Megatron's linears ignore theirs: checkpoints move between precisions."""
        if (self._fp8_delayed is not None and isinstance(state, dict)
                and state.get("fp8_recipe") == "delayed"):
            self._fp8_delayed.load(state)

    @property
    def transport(self) -> comm.Transport:
        if self._transport is None:
            with about(f"layer {self.overlap_plan.layer!r}"):  # may exchange the topology
                self._transport = comm.transport_for(self.tp_group, self.overlap_backend,
                                                     self.weight.device)
        return self._transport

    @property
    def ring_orders(self) -> dict[str, RingOrder]:
        """The ring order of each pass that runs a ring (its `ring_order` setting against
        the TP group's topology); collective over the TP group the first time."""
        if self._orders is None:
            tp, plan = self.transport, self.overlap_plan
            topo = getattr(tp, "topology", None)
            if topo is None and tp.world_size > 1:
                with about(f"layer {plan.layer!r}"):
                    topo = comm.topology(self.tp_group, self.weight.device)
            orders = {}
            for s in (plan.fprop, plan.dgrad, plan.wgrad):
                order = None if s is None else ring_order(s, plan.sequence_parallel, topo)
                if order is not None:
                    orders[s.pass_name] = order
                    if order.note:  # the order asked for (or auto's) could not run
                        say_once(logging.WARNING, f"megatron_overlap: {s.name}: {order.note}")
            self._orders = orders
            if topo is not None and len(topo.nodes) > 1:  # aggregate auto: pairs within a node
                self.overlap_plan = plan.plain_across_nodes(
                    [p for p in plan.auto_pairs if orders[p].order == "flat"])
                say_once(logging.INFO, f"megatron_overlap: {plan.layer}: TP group over "
                     f"{topo.describe()}; ring order "
                     + ", ".join(f"{p} {o.label}" for p, o in orders.items())
                     + f"; transport per peer: {comm.describe_peers(tp)}")
        return self._orders

    @functools.cached_property
    def _layouts(self) -> dict[str, Any]:
        """Per pass: the hierarchical ring layout (ranks per node), or None (flat); made
        at the first forward (when the ring orders are fixed), kept for every call after."""
        return {p: o.nodes for p, o in self.ring_orders.items()}

    @functools.cached_property
    def _use_megatron(self) -> bool:
        """Whether this layer runs Megatron's own forward; fixed at construction, so worked
        out at the first call and kept. Frozen weights run our path too (the backward
        skips the wgrad): Megatron's frozen path would wait on its own, unbounded
        collectives."""
        if self.precision.fp8:  # Megatron's forward would run bf16: ours runs even unoverlapped
            return False
        fallback = checks.megatron_fallback(self)
        missing_apex = self.gradient_accumulation_fusion and not HAVE_APEX_WGRAD
        return (fallback or not self.overlap_plan.enabled) and not missing_apex

    def _fp8_weight(self, w: torch.Tensor) -> Optional[tuple]:
        """(the FP8 weight cache, whether this forward reuses it) for the layer's own
        weight, or None: no cache (bf16, row-wise, disable_parameter_transpose_cache) or a
        weight supplied to this call. Reads and clears is_first_microbatch, as Megatron's TE
        layers do."""
        first = self.is_first_microbatch
        if first is not False:
            self.is_first_microbatch = False
        cache = self._fp8_cache
        if cache is None:
            return None
        if w is not self.weight:  # it took the step's first micro-batch: no reuse this step
            cache.invalidate()
            return None
        reuse = cache.reuse(w, first)
        return None if reuse is None else (cache, reuse)

    def _note_tokens(self, x: torch.Tensor, full: bool) -> None:
        tokens = token_rows(x) * (1 if full else self.transport.world_size)
        if tokens > self._max_tokens:  # (nn.Module attribute writes are slow: only on change)
            self._max_tokens, self._elem = tokens, x.element_size()

    def _moved_row(self, pass_name: str, es: int, width: int) -> int:
        """Bytes per token row a pass moves: `width` bytes for what an FP8 layer gathers
        (the column forward's input, the column dgrad's gather of the FP8 input for an FP8
        wgrad, the row dgrad's gradient), plus the row's scale (`overlap.fp8.TAIL`) under
        row-wise scaling; else `width` activations (reductions stay in their dtype)."""
        p, column = self.precision, isinstance(self, ColumnParallelLinear)
        if not p.fp8:
            return width * es
        gathers = {"fprop": column, "wgrad": False,
                   "dgrad": (not column) or (p.wgrad and not self.overlap_plan.rs_dgrad)}
        if not gathers[pass_name]:
            return width * es
        return width + (TAIL if p.recipe == "rowwise" else 0)

    def overlap_rows(self) -> list[dict]:
        """This layer's effective per-pass settings (console table, wandb), with the
        bytes of the communication buffer each pass used at the largest token count
        seen so far (0 before the first forward), and the layer's precision."""
        t, es = self._max_tokens, getattr(self, "_elem", 0)
        width = self.input_size if isinstance(self, ColumnParallelLinear) else self.output_size
        per_pass = {p: t * self._moved_row(p, es, width) for p in ("fprop", "dgrad", "wgrad")}
        if not isinstance(self, ColumnParallelLinear):
            per_pass["wgrad"] = 0
        tp, orders = self.transport, self.ring_orders  # (the orders may change the plan)
        rows = self.overlap_plan.rows(tp.world_size, tp.name, per_pass, backends=tp.backends,
                                      orders=orders, transport=comm.describe_peers(tp))
        return [{**r, "precision": self.precision.describe()} for r in rows]


class OverlapColumnParallelLinear(_OverlapMixin, ColumnParallelLinear):
    """ColumnParallelLinear whose SP all-gather hides under the GEMM."""

    def __init__(self, input_size: int, output_size: int, *, config: Any,
                 tp_comm_buffer_name: Optional[str] = None, is_expert: bool = False,
                 name: Optional[str] = None, **kwargs: Any) -> None:
        with _without_fusion_check(config) as fuse:
            super().__init__(input_size, output_size, config=config,
                             tp_comm_buffer_name=tp_comm_buffer_name, is_expert=is_expert, **kwargs)
        self._setup_overlap("column", tp_comm_buffer_name, is_expert, name, fuse)

    @functools.cached_property
    def _allreduce_dgrad(self) -> bool:
        """Without SP the input grad is all-reduced (fixed at construction; asked per call)."""
        return (self.transport.world_size > 1 and not self.sequence_parallel
                and not getattr(self, "disable_grad_reduce", False))

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None):
        w = self.weight if weight is None else weight
        if w is None or self._use_megatron:
            return super().forward(input_, weight, runtime_gather_output)
        if weight is not None and weight.shape != (self.output_size_per_partition, self.input_size):
            raise RuntimeError(f"{self.overlap_plan.layer}: supplied weight's shape is "
                               f"{tuple(weight.shape)}, not "
                               f"{(self.output_size_per_partition, self.input_size)} as expected")
        checks.check_column(self, input_, w)  # before any transfer: a refusal leaves no trace
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        # ranks that disagree: diagnosed on all, nothing started
        audit = agree.check(self, input_, {"weight trainable": w.requires_grad,
                                           "gather_output": bool(gather)})
        bias = None if self.skip_bias_add else self.bias
        if checks.is_empty(input_):
            out = checks.empty_column(self, input_, w, bias)
        else:
            self._note_tokens(input_, full=not self.sequence_parallel)
            layouts = self._layouts  # first: the ring orders may change the plan (ring_orders)
            out = ColumnParallelMatmul.apply(input_, w, bias, self.overlap_plan, self.transport,
                                             self.gradient_accumulation_fusion, self._allreduce_dgrad,
                                             layouts, self.pass_graphs, audit, self.precision,
                                             self._fp8_weight(w), torch.is_grad_enabled(),
                                             self._fp8_delayed)
        if gather and self.transport.world_size > 1:  # bounded, unlike Megatron's gather
            out = GatherLastDim.apply(out, self.transport, self.overlap_plan.op_name("gather_output"))
        return out, (self.bias if self.skip_bias_add else None)


class OverlapRowParallelLinear(_OverlapMixin, RowParallelLinear):
    """RowParallelLinear whose SP reduce-scatter hides under the GEMM."""

    def __init__(self, input_size: int, output_size: int, *, config: Any,
                 tp_comm_buffer_name: Optional[str] = None, is_expert: bool = False,
                 name: Optional[str] = None, **kwargs: Any) -> None:
        with _without_fusion_check(config) as fuse:
            super().__init__(input_size, output_size, config=config,
                             tp_comm_buffer_name=tp_comm_buffer_name, is_expert=is_expert, **kwargs)
        self._setup_overlap("row", tp_comm_buffer_name, is_expert, name, fuse)

    def forward(self, input_: torch.Tensor):
        if self._use_megatron:
            return super().forward(input_)
        w = self.weight
        checks.check_row(self, input_)  # before any transfer: a refusal leaves no trace
        # ranks that disagree: diagnosed on all, nothing started
        audit = agree.check(self, input_, {"weight trainable": w.requires_grad})
        x = input_
        if not self.input_is_parallel and self.transport.world_size > 1:  # its grad's gather bounded
            x = ScatterLastDim.apply(input_, self.transport, self.overlap_plan.op_name("scatter_input"))
        bias = None if self.skip_bias_add else self.bias  # added inside the pass (row_fprop)
        if checks.is_empty(x):
            out = checks.empty_row(self, x, bias)
        else:
            self._note_tokens(input_, full=True)
            layouts = self._layouts  # first: the ring orders may change the plan (ring_orders)
            out = RowParallelMatmul.apply(x, w, bias, self.overlap_plan, self.transport,
                                          self.gradient_accumulation_fusion, layouts, self.pass_graphs,
                                          audit, self.precision, self._fp8_weight(w),
                                          torch.is_grad_enabled(), self._fp8_delayed)
        return out, (self.bias if self.skip_bias_add else None)
