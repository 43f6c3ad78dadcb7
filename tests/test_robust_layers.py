"""Inputs checked at the layer's door (TP=2, gloo): what Megatron's own layer takes
(non-contiguous, 2-D, no input grad, no_grad, the empty sequence) gives Megatron's
result; what it cannot take is refused before any transfer, naming the layer, what
was expected, what came and the fix; and the next valid call, on every rank, still
equals Megatron's, also when only one rank made the bad call."""

import pytest

from helpers import dist
from helpers.robust import KINDS, door, kind_id, one_rank_refused

TP = 2
ENV = {"MEGATRON_OVERLAP_TIMEOUT_S": "20"}  # a broken case fails in seconds, never hangs
_cache: dict = {}


def _results(fn):
    if fn.__name__ not in _cache:
        per_rank = dist.run(fn, TP, env=ENV, timeout=180)
        _cache[fn.__name__] = per_rank
    return _cache[fn.__name__]


LAYER = {"column": "'qkv (column)'", "row": "'proj (row)'"}
WIDTH = {"column": 16, "row": 12}  # input_size 16; row: 24 / TP
# refusal -> what its message must say (expected, got, fix); {h}: the layer's input width
SAYS = {
    "1d": ["expected a 3-D [sequence, batch, {h}] or 2-D [tokens, {h}] input", "got 1-D ({h},)",
           "reshape it to [s, b, h]"],
    "4d": ["expected a 3-D", "got 4-D (2, 2, 2, {h})", "reshape it"],
    "hidden": ["expected a last (hidden) dimension of {h}", "got (4, 2, {h1})",
               "give the layer inputs of width {h}"],
    "dtype": ["input dtype torch.float64 does not match the weights' torch.float32",
              "cast the input with .to(torch.float32)"],
    "device": ["input is on meta, the weights on cpu", "move the input with .to('cpu')"],
    "not_a_tensor": ["expected a torch.Tensor input, got list"],
    "sequence_vs_tp": ["reduce-scatters the sequence over TP=2", "sequence length 9",
                       "not a multiple of 2", "pad the sequence to a multiple of 2"],
    "num_splits": ["num_splits=2 does not divide the 1 rows per rank",
                   "pick a num_splits that divides 1"],
}
REFUSED = [(kind, sp, name) for kind, sp, _ in KINDS for name in SAYS
           if (name != "sequence_vs_tp" or (kind == "row" and sp))
           and (name != "num_splits" or kind == "row" or sp)]
ACCEPTED = ["non_contiguous", "2d", "input_without_grad", "no_grad", "empty_sequence", "empty_2d",
            "forward_only"]


@pytest.mark.parametrize("kind,sp,name", REFUSED, ids=lambda v: str(v))
def test_bad_input_is_refused_at_the_door_then_the_next_call_works(kind, sp, name):
    for rank, got in enumerate(_results(door)):
        msg = got[(kind_id(kind, sp), "refused", name)]
        assert msg is not None, f"rank {rank}: {kind} sp={sp} took the {name} input"
        assert msg.startswith(f"LayerInputError: megatron_overlap: layer {LAYER[kind]}: "), msg
        h = WIDTH[kind]
        for part in SAYS[name]:
            assert part.format(h=h, h1=h + 1) in msg, f"{part!r} not in {msg!r}"
        after = got[(kind_id(kind, sp), "after", name)]
        assert after["same_shapes"] and after["err"] <= 1e-5, f"rank {rank}, call after: {after}"


@pytest.mark.parametrize("kind,sp", [(k, s) for k, s, _ in KINDS], ids=lambda v: str(v))
@pytest.mark.parametrize("name", ACCEPTED)
def test_inputs_megatron_takes_give_megatrons_result(kind, sp, name):
    for rank, got in enumerate(_results(door)):
        r = got[(kind_id(kind, sp), "accepted", name)]
        assert r["same_shapes"], f"rank {rank}: shapes differ: {r}"
        assert r["err"] <= 1e-5, f"rank {rank}: {name}: relative error {r['err']} ({r['shapes']})"
        if name.startswith("empty"):
            assert r["shapes"][0][0] == 0  # Megatron's empty output


@pytest.mark.parametrize("kind,sp", [(k, s) for k, s, _ in (KINDS[0], KINDS[2])],
                         ids=lambda v: str(v))
def test_one_rank_refused_alone_leaves_no_trace(kind, sp):
    per_rank = _results(one_rank_refused)
    for step in ("first", "later"):
        assert "expected a last (hidden) dimension" in per_rank[0][(kind_id(kind, sp), step, "message")]
        for rank, got in enumerate(per_rank):
            r = got[(kind_id(kind, sp), step)]
            assert r["same_shapes"] and r["err"] <= 1e-5, f"rank {rank} {step}: {r}"
