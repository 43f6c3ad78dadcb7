"""Delayed scaling (fp8_recipe='delayed', Megatron's default recipe, with Transformer
Engine's semantics): our layers step after step against the FP8 reference quantizing
with the scales TE's rule gives from the whole tensors' past amaxes
(helpers/fp8_delayed.py), the histories restored from a checkpoint, and the numbers of
the update itself.

Bounds: as tests/test_fp8_layers.py (bit-equal where nothing is summed over ranks; the
reductions within a few roundings): the scales are the reference's to the bit, so each
step's FP8 operands are too. Step 0 quantizes with scale 1 (no history yet, as TE); the
tensors grow 8x at step 1, so its casts saturate, in the layer as in the reference."""

import pytest
import torch

from helpers import dist
from helpers.fp8_delayed import FACTORS, DelayedCase, next_scale, run_cases
from helpers.fp8_layers import Fp8Case

CASES = [
    DelayedCase(Fp8Case("column", "ring", True, "bfloat16")),
    DelayedCase(Fp8Case("column", "rs_dgrad_pipeline2", True, "bfloat16"), 3, "max", 1),
    DelayedCase(Fp8Case("column", "ring_aggregate", False, "float32"), 2, "max"),
    DelayedCase(Fp8Case("column", "ring", True, "bfloat16", fp8_wgrad=False, main_grad=True)),
    DelayedCase(Fp8Case("row", "pipeline2", True, "bfloat16"), 3, "max", 1),
    DelayedCase(Fp8Case("row", "ring_dgrad_aggregate", True, "float32", fp8="e4m3")),
    DelayedCase(Fp8Case("row", "rs_off", False, "bfloat16", main_grad=True), 2, "most_recent", 2),
    # 2 micro-batches a step: the FP8 weight made at the first, reused at the second
    DelayedCase(Fp8Case("column", "ring", True, "bfloat16"), 3, "max", micros=2),
    DelayedCase(Fp8Case("row", "pipeline2", True, "bfloat16"), micros=2),
]
_results: dict[int, list] = {}


def _results_for(tp: int) -> list[dict]:
    if tp not in _results:
        _results[tp] = dist.run(run_cases, tp, CASES, timeout=600)
    return _results[tp]


@pytest.mark.parametrize("tp,case", [(tp, c) for tp in (2, 4) for c in CASES],
                         ids=lambda v: f"tp{v}" if isinstance(v, int) else v.id)
def test_delayed_layer_matches_the_reference_step_after_step(tp, case):
    reduced = "input_grad" if case.layer.kind == "column" else "output"
    bound = 1e-6 if case.layer.dtype == "float32" else (tp + 1) * 2.0 ** -9
    for rank, per_rank in enumerate(_results_for(tp)):
        got = per_rank[case.id]
        assert got["precision"].startswith("fp8 delayed") and f"history {case.history} " \
            f"({case.algo}), margin {case.margin}" in got["precision"], got["precision"]
        assert len(got["steps"]) == len(FACTORS) * case.micros
        for step, results in enumerate(got["steps"]):
            for key, v in results.items():
                if key == reduced:
                    assert v["rel"] <= bound, (rank, step, key, v)
                else:
                    assert v["equal"], (rank, step, key, v)
        # after every micro-batch the layer's scales are the rule's, to the bit (the weight's
        # moving only where it was quantized), and they moved: 1 first, then the amaxes'
        assert got["held"] == got["want_held"], (rank, got["held"], got["want_held"])
        assert got["scales"][0] == {"input": 1.0, "weight": 1.0, "grad": 1.0}
        assert len({s["input"] for s in got["scales"]}) > 2


@pytest.mark.parametrize("tp", (2, 4))
def test_histories_come_back_from_the_checkpoint(tp):
    """A layer built anew and given the first one's state dict takes the next step to the
    bit (its scales come from the restored histories); the state is the layer's
    `_extra_state`, one history per FP8 tensor, as long as configured; so does the same
    layer given the state dict again once its histories exist (loaded in place)."""
    for per_rank in _results_for(tp):
        for case in CASES:
            got = per_rank[case.id]
            assert got["restored"] == [True, True], case.id
            assert got["extra"] == ["grad", "input", "weight"]
            assert len(got["history"]) == case.history and got["history"][-1] > 0


@pytest.mark.parametrize("algo,margin", [("max", 0), ("most_recent", 1), ("max", 3)])
def test_the_update_follows_transformer_engines_rule(algo, margin):
    """overlap.fp8.update_scale on its own: the window of the last 3 amaxes, 'max'
    against 'most_recent', the margin; the scale to the bit of the rule's."""
    from megatron_overlap.overlap.fp8 import AmaxHistory, scale_value, update_scale

    e5m2 = torch.float8_e5m2
    case = DelayedCase(Fp8Case("column", "ring", True, "bfloat16"), 3, algo, margin)
    st, seen, want = AmaxHistory(3, torch.device("cpu")), [], 1.0
    assert float(scale_value(st.scale)) == 1.0 and st.history.tolist() == [0.0] * 3
    for a in (2.0, 0.5, 0.3, 7.0, 0.25, 0.125, 0.0625, 3.0):
        update_scale(st, torch.tensor(a), e5m2, margin, algo)
        seen.append(float(torch.tensor(a)))  # the amax as the layer has it: float32
        want = next_scale(seen, want, e5m2, case)
        assert float(scale_value(st.scale)) == want, (seen, float(scale_value(st.scale)), want)
        assert st.history.tolist() == pytest.approx(([0.0] * 3 + seen)[-3:])


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan")])
def test_an_amax_of_zero_inf_or_nan_keeps_the_scale(bad):
    """As TE: the scale stays where the amax (most_recent) is 0, inf or NaN; a tiny one
    gives float32's largest scale, never inf (0 x inf would be NaN in the cast)."""
    from megatron_overlap.overlap.fp8 import AmaxHistory, scale_value, update_scale

    st = AmaxHistory(1, torch.device("cpu"))
    update_scale(st, torch.tensor(4.0), torch.float8_e4m3fn, 0, "most_recent")
    assert float(scale_value(st.scale)) == 448.0 / 4.0
    update_scale(st, torch.tensor(bad), torch.float8_e4m3fn, 0, "most_recent")
    assert float(scale_value(st.scale)) == 448.0 / 4.0
    update_scale(st, torch.tensor(1e-45), torch.float8_e4m3fn, 0, "most_recent")
    assert float(scale_value(st.scale)) == torch.finfo(torch.float32).max


def test_a_nan_amax_leaves_a_windows_max_to_the_others():
    """TE's reductions skip NaN (fmaxf): with 'max' over 4 amaxes, a NaN among them neither
    sticks nor freezes the scale: after 2, NaN, 1, 0.5, 0.25 the window is (NaN, 1, 0.5,
    0.25) and the scale fp8 max / 1."""
    from megatron_overlap.overlap.fp8 import AmaxHistory, scale_value, update_scale

    st = AmaxHistory(4, torch.device("cpu"))
    for a in (2.0, float("nan"), 1.0, 0.5, 0.25):
        update_scale(st, torch.tensor(a), torch.float8_e4m3fn, 0, "max")
    assert float(scale_value(st.scale)) == 448.0
    assert st.history.tolist() == [0.0, 1.0, 0.5, 0.25]


def test_a_history_of_another_length_keeps_its_newest_amaxes():
    """A checkpoint's history loaded into a layer configured with another length: the
    newest amaxes kept (zeros before them where it is longer), the scale as saved; into
    histories already made, in place (their addresses kept, for replayed passes)."""
    from megatron_overlap.layers.fp8 import DelayedScales
    from megatron_overlap.layers.precision import Precision
    from megatron_overlap.overlap.fp8 import scale_value

    saved = {"fp8_recipe": "delayed", "amax_history": {"input": torch.arange(1.0, 6.0)},
             "scale": {"input": torch.tensor(3.0)}}
    for length, want in ((3, [3.0, 4.0, 5.0]), (7, [0.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0])):
        d = DelayedScales(Precision("delayed", torch.float8_e4m3fn, torch.float8_e5m2,
                                    history=length, algo="max"))
        d.load(saved)  # before first use
        st = d.get("input", torch.device("cpu"))
        assert st.history.tolist() == want and float(scale_value(st.scale)) == 3.0
        ptr = st.history.data_ptr()
        d.load({**saved, "scale": {"input": torch.tensor(5.0)}})  # in place
        assert d.get("input", torch.device("cpu")).history.data_ptr() == ptr
        assert float(scale_value(st.scale)) == 5.0 and st.history.tolist() == want
        assert d.state()["amax_history"]["input"].tolist() == want


def test_a_layer_s_histories_are_rows_of_one_block_and_a_pass_updates_its_own():
    """`DelayedScales` keeps every role's history and scale pair as rows of one block (one
    kernel updates a pass's), each made at its first use; a record updates only its
    roles' rows, with the group's max of the amaxes exchanged (here one rank: its own),
    and refuses roles that are not adjacent rows of one FP8 type."""
    from megatron_overlap.comm.null import NullTransport
    from megatron_overlap.layers.fp8 import DelayedScales
    from megatron_overlap.layers.precision import Precision
    from megatron_overlap.overlap.fp8 import scale_value

    d = DelayedScales(Precision("delayed", torch.float8_e4m3fn, torch.float8_e5m2,
                                history=2, algo="max"))
    cpu = torch.device("cpu")
    rows = {r: d.get(r, cpu) for r in ("grad", "input", "weight")}
    base = rows["input"].history.untyped_storage().data_ptr()
    assert all(st.history.untyped_storage().data_ptr() == base for st in rows.values())
    tp = NullTransport(1, 0)
    d.record(("input", "weight"), torch.tensor([4.0, 224.0]), tp, "qkv_fprop")
    assert [float(scale_value(rows[r].scale)) for r in ("input", "weight", "grad")] == [
        112.0, 2.0, 1.0]
    assert [rows[r].history.tolist() for r in ("input", "weight", "grad")] == [
        [0.0, 4.0], [0.0, 224.0], [0.0, 0.0]]
    d.record(("input",), torch.tensor([8.0, 99.0]), tp, "qkv_fprop")  # the weight's place unread
    assert rows["input"].history.tolist() == [4.0, 8.0] and float(scale_value(rows["input"].scale)) == 56.0
    assert rows["weight"].history.tolist() == [0.0, 224.0]
    d.record(("grad",), torch.tensor([57344.0 / 8]), tp, "qkv_dgrad")
    assert rows["grad"].history.tolist() == [0.0, 7168.0]
    assert float(scale_value(rows["grad"].scale)) == 8.0
    for bad in (("weight", "input"), ("input", "grad"), ("weight", "grad")):
        with pytest.raises(ValueError, match="adjacent roles of one FP8 type"):
            d.record(bad, torch.ones(2), tp, "qkv_fprop")
