"""The FP8 operands of one layer's passes, made from a layer's `Precision`: the
'tensorwise' recipe (a scale per tensor, from its current amax) or 'rowwise' (a scale
per row of the first GEMM operand and per output column of the second, from the amax
along the contracted dimension; the wgrad in the parameters' dtype).

- Forward: the input is quantized once, before any transfer; when it is to be gathered
  (sequence parallelism) its amax is the TP group's, so the gathered FP8 tensor has one
  scale. The weight is quantized with its own shard's amax. Both, with their scales, are
  what the forward leaves for the backward, each in the layout the backward reads
  (`Fp8Forward`: allocated by the caller, so a replayed pass writes them at the same
  addresses).
- Backward: the output gradient is quantized (e5m2 under 'hybrid'), with the TP group's
  amax where it is gathered (a row layer under SP). The dgrad reuses the forward's FP8
  weight, transposed; the wgrad reuses the FP8 input (the column layer gathers the
  forward's FP8 input, half the bytes of bf16) and the FP8 gradient, transposed, when
  fp8_wgrad is on; otherwise it runs in the parameters' dtype on the saved input.
- Delayed (Megatron's default recipe, TE's semantics): each tensor quantized with the
  scale its amax history gives (`DelayedScales`), no amax read before the cast; the
  pass's amaxes, reduced over the TP group, recorded after, and the next scales set.
- Row-wise: each rank quantizes its own rows, no amax exchange; the first operand of
  every FP8 GEMM (the input, the output gradient) is row-scaled (`rows_quantized`: its
  scales travel in its rows, through any gather). The weight is quantized per row of W
  for the forward (x @ W^T: a scale per output column) and, in the backward, again from
  the parameters per column of W (g @ W contracts over W's rows).
- A transposed copy (`col_major`) is what cuBLAS needs for the second operand of every
  FP8 GEMM (column-major) and for the wgrad's first (row-major g^T): Transformer
  Engine keeps the same 'columnwise' copies. Transposing FP8 data is exact. A tensor
  quantized on this rank and read transposed (the weight by the dgrad; a row layer's
  input and a column layer's gradient by the wgrad) gets that copy from its cast's own
  kernel (TE's cast-transpose); only a gathered one (a column layer's input, a row
  layer's gradient) is transposed after its gather, in the wgrad pass.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..comm.transport import Transport
from ..overlap.fp8 import (PAIR, TAIL, AmaxHistory, RowScaledGemm, ScaledGemm, amax,
                           delayed_quantize, every_rank, group_amaxes, pair_of, quantize,
                           quantize_current, row_scales, rows_dequantized, rows_quantized,
                           scale_pair, scale_value, transposed, update_scales)
from .precision import Precision


def col_major(t: torch.Tensor) -> torch.Tensor:
    """`t` (2-D) with the same values, laid out column-major: `t` itself where it already
    is (made so by its cast: `quantize(..., out_t=)`), else a transposed copy."""
    if t.dim() == 2 and t.stride(0) == 1 and t.stride(1) == t.shape[0]:
        return t
    return transposed(t).t()


def quantized(x: torch.Tensor, dtype: torch.dtype, tp: Optional[Transport] = None,
              op: str = "", col: bool = False) -> tuple[torch.Tensor, torch.Tensor,
                                                        Optional[torch.Tensor]]:
    """(x in FP8, its scale pair, and with `col` the same values column-major, written by
    the cast's kernel, else None); the amax is the TP group's when `tp` is given (a tensor the
    pass gathers: `op`'s amax exchange, named '<op>_amax')."""
    a = group_amaxes(x, tp, f"{op}_amax") if tp is not None else amax(x)
    s, t = scale_pair(x.device), x.new_empty(x.shape[::-1], dtype=dtype) if col else None
    return quantize_current(x, a, dtype, s, out_t=t), s, (None if t is None else t.t())


class DelayedScales:
    """A layer's delayed scaling (fp8_recipe 'delayed', Transformer Engine's semantics):
    for each FP8 tensor of its GEMMs (the input, the weight, the output gradient) an
    `AmaxHistory`. A quantization uses the scale its history holds, then records its
    amax, the TP group's (so every rank keeps the same history: a gathered tensor has
    one scale, and the checkpoint, which keeps TP rank 0's, restores every rank), and
    the scale for the next one follows. The histories are the layer's extra state in a
    checkpoint (`state`, `load`)."""

    ROLES = ("input", "weight", "grad")  # their rows in the block, in this order

    def __init__(self, p: Precision):
        self.p = p
        self._states: dict[str, AmaxHistory] = {}
        self._loaded: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # every role's history and scale pair, rows of one block each (made at the first
        # use): a pass's histories are adjacent rows, updated by one kernel (`record`)
        self._block: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    def get(self, role: str, device: torch.device) -> AmaxHistory:
        """`role`'s history, made at its first use (from a loaded checkpoint where there
        was one), a row of the layer's block, which the first use of any role makes on
        `device`."""
        st = self._states.get(role)
        if st is None:
            if self._block is None:
                n = len(self.ROLES)
                self._block = (torch.empty((n, self.p.history), dtype=torch.float32,
                                           device=device),
                               torch.empty((n, *PAIR), dtype=torch.float32, device=device))
            i = self.ROLES.index(role)
            st = self._states[role] = AmaxHistory(self.p.history, device,
                                                  self._block[0][i], self._block[1][i])
            if role in self._loaded:
                self._copy_in(st, *self._loaded.pop(role))
        return st

    def quantize(self, role: str, x: torch.Tensor, dtype: torch.dtype, used: torch.Tensor,
                 amax_out: torch.Tensor, out: Optional[torch.Tensor] = None,
                 out_t: Optional[torch.Tensor] = None,
                 chunks: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """`x` quantized with `role`'s current scale (into `used`), its amax into `amax_out`;
        `chunks`: `out`'s rows chunk-major (`overlap.fp8.delayed_quantize`)."""
        return delayed_quantize(x, self.get(role, x.device), dtype, used, amax_out, out, out_t,
                                chunks)

    def record(self, roles: tuple[str, ...], local: torch.Tensor, tp: Transport, op: str
               ) -> None:
        """The amaxes `local` (this rank's; the first len(roles) are `roles`', adjacent in
        ROLES and of one FP8 type: the input's and weight's, or the gradient's) exchanged
        over the TP group (one exchange, '<op>_amax') and recorded, and each role's next
        scale set: one update of their rows. Called at the end of the pass: nothing in it
        reads the histories' scales after its casts, so the exchange waits on nothing the
        pass's transfers need."""
        first = self.ROLES.index(roles[0])
        rows = slice(first, first + len(roles))
        if self.ROLES[rows] != tuple(roles) or ("grad" in roles and len(roles) > 1):
            raise ValueError(f"{op}: delayed scaling records adjacent roles of one FP8 type "
                             f"at a time, not {roles}")
        every = every_rank(local, tp, f"{op}_amax")[:, :len(roles)]
        dtype = self.p.grad if roles[0] == "grad" else self.p.fwd
        update_scales(self._block[0][rows], self._block[1][rows], every, dtype, self.p.margin,
                      self.p.algo)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for role in self.ROLES if role in self._states
                     for t in self._states[role].tensors())

    def state(self) -> dict:
        """What a checkpoint keeps (the layer's extra state): per role, its amax history
        (oldest first) and scale (the value, as TE keeps it), on the CPU."""
        held = {r: (st.history, st.scale) for r, st in self._states.items()}
        held.update({r: v for r, v in self._loaded.items() if r not in held})
        return {"fp8_recipe": "delayed",
                "amax_history": {r: h.detach().cpu().clone() for r, (h, _) in held.items()},
                "scale": {r: scale_value(s).detach().cpu().clone()
                          for r, (_, s) in held.items()}}

    def load(self, state: dict) -> None:
        """Restore `state()`: into the histories in place where they exist (their addresses
        stay, for replayed passes), else at their first use. A history of another length
        keeps its newest amaxes."""
        for role, h in state.get("amax_history", {}).items():
            s = state["scale"][role]
            if role in self._states:
                self._copy_in(self._states[role], h, s)
            else:
                self._loaded[role] = (h, s)

    @staticmethod
    def _copy_in(st: AmaxHistory, h: torch.Tensor, s: torch.Tensor) -> None:
        n = min(len(h), len(st.history))
        with torch.no_grad():
            st.history.zero_()
            if n:
                st.history[-n:].copy_(h[-n:])
            s = scale_value(s).to(st.scale)
            st.scale.copy_(pair_of(s))


_STALE = object()  # a cache key no weight has


class Fp8WeightCache:
    """A layer's FP8 weight kept across the micro-batches of a step (tensorwise), as
    Transformer Engine's parameter cache under Megatron: the weight quantized (and, by the
    same kernel, transposed for the dgrad) at a step's first micro-batch, reused by the rest. Megatron's
    schedules say which micro-batch is first (`set_is_first_microbatch` sets the layer's
    `is_first_microbatch`; `disable_parameter_transpose_cache=True` turns the cache off).

    - Written only at a step's first micro-batch (the flag set): nothing in flight reads
      it then (under pipeline parallelism earlier micro-batches' backwards do, later in a
      step). Any other forward that does not reuse it quantizes into tensors of its own.
    - Reused only once a schedule has been seen driving the flag (set again after the
      first forward: a loop that never sets it quantizes at every forward), and only while
      the weight is the tensor it was made from, unchanged since (its address and autograd
      version; a change within a step leaves the cache unused until the next step).
      Like TE's, it relies on the flag for updates that bump no version (`.data` writes,
      as Megatron's optimizers make): a forward outside the schedule after such an update
      (evaluation with the layer's own loop) should set `is_first_microbatch` first.
    - Its tensors live as long as the layer: a replayed pass reads and writes them at the
      same addresses."""

    def __init__(self) -> None:
        self.w8: Optional[torch.Tensor] = None
        self.w_scale: Optional[torch.Tensor] = None
        self.w8t: Optional[torch.Tensor] = None
        self._made_from: object = None  # None: never made; _STALE: not to be reused
        self.driven = False  # a schedule set is_first_microbatch after the first forward

    def reuse(self, weight: torch.Tensor, first: Optional[bool]) -> Optional[bool]:
        """For this forward (`first`: the layer's is_first_microbatch as the schedule left
        it): True, reuse the cache; False, make it anew from `weight` (a step's first
        micro-batch); None, leave it alone (this forward quantizes into its own tensors)."""
        if first and self._made_from is not None:
            self.driven = True
        key = (weight.data_ptr(), weight._version, tuple(weight.shape), weight.dtype,
               weight.device)
        if first:
            self._made_from = key
            return False
        if self.driven and first is False and key == self._made_from:
            return True
        self.invalidate()
        return None

    def invalidate(self) -> None:
        """Not reused again before the next step's first micro-batch makes it anew."""
        if self._made_from is not None:
            self._made_from = _STALE

    def tensors(self, weight: torch.Tensor, fwd: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w8, w_scale, w8t), allocated once (again if the weight's shape, type or
        device changed)."""
        if (self.w8 is None or self.w8.shape != weight.shape or self.w8.dtype != fwd
                or self.w8.device != weight.device):
            self.w8 = torch.empty(weight.shape, dtype=fwd, device=weight.device)
            self.w8t = torch.empty(weight.shape[::-1], dtype=fwd, device=weight.device)
            self.w_scale = scale_pair(weight.device)
        return self.w8, self.w_scale, self.w8t


class Fp8Forward:
    """What an FP8 forward pass writes for its backward: the FP8 input rows and weight,
    with their scales. `rows`: the input flattened to [tokens, k]. Tensorwise, the weight
    is also written transposed (`w8t`, the dgrad's layout) by its cast's kernel (with
    `weight_t`; always into a `cache`: the layer's Fp8WeightCache, whose weight this pass
    quantizes, or, with `reuse`, only reads). `input_t` (tensorwise): the input's cast also
    writes it transposed (`x8t`), what a wgrad on this rank's own, ungathered input takes,
    kept for the backward in place of `x8`. `delayed`: the layer's DelayedScales (fp8_recipe
    'delayed'), whose histories give the scales and record the amaxes. `given`: the input
    already quantized for this pass by the kernel that made it (`fp8_act.Fp8Activation`,
    tensorwise or delayed): its FP8 tensors, scale and amax are this pass's, not cast
    again."""

    def __init__(self, p: Precision, rows: torch.Tensor, weight: torch.Tensor,
                 cache: Optional[Fp8WeightCache] = None, reuse: bool = False,
                 input_t: bool = False, weight_t: bool = True,
                 delayed: Optional[DelayedScales] = None, given=None, layer: str = ""):
        self.p, self.delayed, self.given = p, delayed, given
        self.rowwise = p.recipe == "rowwise"
        tokens, k = rows.shape
        f32 = dict(dtype=torch.float32, device=rows.device)
        if given is not None:
            if (self.rowwise or given.fp8.dtype != p.fwd or (given.fp8_t is not None) != input_t
                    or (given.amax is None) != (delayed is None)):
                raise ValueError(f"{layer}: an FP8 input made for {given.fp8.dtype}, transposed "
                                 f"copy {given.fp8_t is not None}, does not fit its forward, which "
                                 f"casts {p.fwd} ({p.recipe}), transposed copy {input_t}: give "
                                 "it the activation in the parameters' dtype, or run the MLP "
                                 "with install(fp8_fused_activation=False)")
            self.x8, self.x8t, self.x_scale = given.fp8, given.fp8_t, given.scale
        else:
            self.x8 = torch.empty((tokens, k + TAIL) if self.rowwise else rows.shape,
                                  dtype=p.fwd, device=rows.device)
            self.x8t = (torch.empty((k, tokens), dtype=p.fwd, device=rows.device)
                        if input_t and not self.rowwise else None)
            self.x_scale = scale_pair(rows.device)  # (row-wise: unused, the scales are in x8)
        self.quantize_weight = not reuse
        if cache is not None and not self.rowwise:
            self.w8, self.w_scale, self.w8t = cache.tensors(weight, p.fwd)
        else:
            self.w8 = torch.empty(weight.shape, dtype=p.fwd, device=weight.device)
            self.w_scale = (torch.empty((weight.shape[0], 1), **f32) if self.rowwise
                            else scale_pair(weight.device))
            self.w8t = (None if self.rowwise or not weight_t else
                        torch.empty(weight.shape[::-1], dtype=p.fwd, device=weight.device))
        self.roles = ("input", "weight") if self.quantize_weight else ("input",)
        if delayed is not None:  # made before the pass: its replay key holds their addresses
            for role in self.roles:
                delayed.get(role, rows.device)

    def tensors(self) -> tuple[Optional[torch.Tensor], ...]:
        held = () if self.delayed is None else self.delayed.tensors()
        # a given input's amaxes (delayed scaling) are made outside the pass, which writes the
        # weight's beside them and exchanges both: bound by address like the rest
        given = () if self.given is None else (self.given.amax,)
        return (self.x8, self.x8t, self.w8, self.x_scale, self.w_scale, self.w8t, *held, *given)

    def record(self, tp: Transport, op: str) -> None:
        """Delayed scaling, at the end of the forward pass: its amaxes recorded (the TP
        group's), the next scales set. Nothing to do otherwise."""
        if self.delayed is not None:
            self.delayed.record(self.roles, self._amaxes, tp, op)

    def kept_input(self) -> torch.Tensor:
        """The FP8 input the backward's wgrad reads: column-major where the cast wrote it
        so (`x8t`), else `x8` (a column layer's: gathered again, row-major)."""
        return self.x8 if self.x8t is None else self.x8t.t()

    def operands(self, x2: torch.Tensor, weight: torch.Tensor, tp: Transport, op: str,
                 gathered: bool, out_dtype: torch.dtype,
                 chunks: Optional[tuple[int, int]] = None
                 ) -> tuple[torch.Tensor, torch.Tensor, ScaledGemm]:
        """Quantize the input (tensorwise: with the group's amax when `gathered`; delayed:
        with its history's scale, the group's amaxes recorded after) and the weight into
        this object's tensors; returns (x8, w8, the scaled GEMM of x8 @ w8^T). `chunks`
        (per-tensor scales only: `overlap.fp8.row_input_chunks`): x8's rows chunk-major
        (`overlap.fp8.chunk_major`), for a row layer's pipelined reduce-scatter, whose
        GEMMs are x8's only readers (its backward reads x8t, in x's order, or x)."""
        if chunks is not None and self.rowwise:
            raise ValueError(f"{op}: an input with row-wise scales is not cast chunk-major")
        fwd, fwd_fast = self.p.fwd, self.p.fast_accum("fprop")
        given = self.given  # the input cast already (`fp8_act`): only the weight is cast here
        if given is not None and (gathered or given.chunks != chunks):
            raise ValueError(f"{op}: an FP8 input made with rows {given.chunks or 'in order'} "
                             f"and its own amax does not fit this pass (rows "
                             f"{chunks or 'in order'}{', gathered' if gathered else ''}): run "
                             "the MLP with install(fp8_fused_activation=False)")
        if self.rowwise:  # each row its own scale: nothing to exchange before a gather
            rows_quantized(x2, fwd, out=self.x8)
            self.w_scale.copy_(row_scales(weight, fwd))
            quantize(weight, self.w_scale, fwd, out=self.w8)
            return self.x8, self.w8, RowScaledGemm(self.w_scale.t(), out_dtype,
                                                   fast_accum=fwd_fast)
        if self.delayed is not None:
            d = self.delayed
            # the input's amax and the weight's, side by side: the exchange `record` makes,
            # of one size on every rank (where the weight is not quantized, its place is
            # exchanged unread)
            if given is not None:
                self._amaxes = given.amax
            else:
                self._amaxes = torch.empty(2, dtype=torch.float32, device=x2.device)
                d.quantize("input", x2, fwd, self.x_scale, self._amaxes[0], out=self.x8,
                           out_t=self.x8t, chunks=chunks)
            if self.quantize_weight:
                d.quantize("weight", weight, fwd, self.w_scale, self._amaxes[1], out=self.w8,
                           out_t=self.w8t)
            return self.x8, self.w8, ScaledGemm(self.x_scale, self.w_scale, out_dtype,
                                                fast_accum=fwd_fast)
        if given is None:
            a = group_amaxes(x2, tp, f"{op}_amax") if gathered else amax(x2)
            quantize_current(x2, a, fwd, self.x_scale, out=self.x8, out_t=self.x8t,
                             chunks=chunks)
        if self.quantize_weight:  # with the dgrad's layout (cached: made once per step)
            quantize_current(weight, amax(weight), fwd, self.w_scale, out=self.w8,
                             out_t=self.w8t)
        return self.x8, self.w8, ScaledGemm(self.x_scale, self.w_scale, out_dtype,
                                            fast_accum=fwd_fast)


class Fp8Backward:
    """A backward pass's FP8 side: the forward's FP8 weight, transposed, and scales
    (tensorwise; the parameters for row-wise), and the gradient's FP8 type. The pass
    quantizes the gradient with `grad()`; `delayed`: the layer's DelayedScales."""

    def __init__(self, p: Precision, w8t: Optional[torch.Tensor], w_scale: torch.Tensor,
                 x_scale: torch.Tensor, weight: Optional[torch.Tensor] = None,
                 delayed: Optional[DelayedScales] = None):
        self.p, self.w8t, self.w_scale, self.x_scale = p, w8t, w_scale, x_scale
        self.rowwise, self.weight, self.delayed = p.recipe == "rowwise", weight, delayed
        self._amax: Optional[torch.Tensor] = None  # delayed: the gradient's, for `record`
        self.given = None  # the gradient, quantized before the pass (`grad`)
        if delayed is not None:  # made before the pass: its replay key holds their addresses
            delayed.get("grad", w_scale.device)

    def tensors(self) -> tuple[Optional[torch.Tensor], ...]:
        held = () if self.delayed is None else self.delayed.tensors()
        # a given gradient's (set before the pass) beyond its rows, which the pass takes as g
        g = self.given
        given = () if g is None else (g.fp8_t, g.scale, g.amax)
        return (self.w8t, self.w_scale, self.x_scale, *held, *given)

    def grad(self, g: torch.Tensor, tp: Transport, op: str, gathered: bool, col: bool = False
             ) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(g in the gradient's FP8 type, its scale, and with `col` g column-major (from
        its cast): the wgrad's layout of a gradient not gathered). Tensorwise: the
        TP group's amax when `gathered`; delayed: the history's scale, the group's amax
        recorded by `record` at the pass's end ('<op>_amax'). Row-wise: (g row-scaled,
        None, None), its rows' amaxes. `given` set (an `fp8_act.Fp8Activation`, the
        gradient quantized by the kernel that made it): its FP8 tensors, not cast again."""
        if self.given is not None:
            return self._given_grad(op, gathered, col)
        if self.rowwise:
            return rows_quantized(g, self.p.grad), None, None
        if self.delayed is None:
            return quantized(g, self.p.grad, tp if gathered else None, op, col)
        t = g.new_empty(g.shape[::-1], dtype=self.p.grad) if col else None
        g_scale = scale_pair(g.device)
        self._amax = torch.empty((), dtype=torch.float32, device=g.device)
        g8 = self.delayed.quantize("grad", g, self.p.grad, g_scale, self._amax, out_t=t)
        return g8, g_scale, (None if t is None else t.t())

    def _given_grad(self, op: str, gathered: bool, col: bool
                    ) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
        g = self.given
        if (self.rowwise or gathered or g.chunks is not None or g.fp8.dtype != self.p.grad
                or (col and g.fp8_t is None) or (g.amax is None) != (self.delayed is None)):
            raise ValueError(f"{op}: an FP8 gradient made as {g.fp8.dtype}"
                             f"{', transposed' if g.fp8_t is not None else ''} with its own "
                             f"amax does not fit this pass ({self.p.grad}, {self.p.recipe}"
                             f"{', gathered' if gathered else ''}"
                             f"{', transposed for the wgrad' if col else ''}): run the MLP "
                             "with install(fp8_fused_activation=False)")
        self._amax = g.amax
        return g.fp8, g.scale, (g.fp8_t.t() if col else None)

    def record(self, tp: Transport, op: str) -> None:
        """Delayed scaling, at the end of the backward pass: the gradient's amax recorded
        (the TP group's), its next scale set. Nothing to do otherwise."""
        if self._amax is not None:
            self.delayed.record(("grad",), self._amax.reshape(1), tp, op)

    def dgrad(self, g_scale: Optional[torch.Tensor], out_dtype: torch.dtype
              ) -> tuple[torch.Tensor, ScaledGemm | RowScaledGemm]:
        """(w8T, the GEMM of g8 @ w8): the schedules multiply by `w8T.t()`, the FP8
        weight column-major. Row-wise: W quantized again, one scale per column of W."""
        if self.rowwise:
            wt = self.weight.t()
            s = row_scales(wt, self.p.fwd)  # [k, 1]: W^T's rows are W's columns
            return quantize(wt, s, self.p.fwd).contiguous(), RowScaledGemm(
                s.t(), out_dtype, fast_accum=self.p.fast_accum("dgrad"))
        return self.w8t, ScaledGemm(g_scale, self.w_scale, out_dtype,
                                    fast_accum=self.p.fast_accum("dgrad"))

    def dequantized(self, g8: torch.Tensor, g_scale: Optional[torch.Tensor],
                    dtype: torch.dtype) -> torch.Tensor:
        """The FP8 gradient `g8` (as the dgrad saw it) back in `dtype`."""
        if self.rowwise:
            return rows_dequantized(g8, dtype)
        return (g8.float() / scale_value(g_scale)).to(dtype)

    def wgrad(self, g_scale: torch.Tensor, out_dtype: torch.dtype) -> ScaledGemm:
        """The GEMM of g8^T @ x8 (the FP8 input's scale)."""
        return ScaledGemm(g_scale, self.x_scale, out_dtype, fast_accum=self.p.fast_accum("wgrad"))
