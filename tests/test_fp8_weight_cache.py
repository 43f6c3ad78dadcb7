"""The FP8 weight made once per step (layers/fp8.py `Fp8WeightCache`): under Megatron's
schedule, which sets each layer's `is_first_microbatch` at a step's first micro-batch (as
it does for Transformer Engine's FP8 parameter cache), the weight's amax, cast and dgrad
transpose run at that micro-batch and the others reuse them. The numbers are those of a
layer that quantizes its weight at every forward (`disable_parameter_transpose_cache=True`,
Megatron's switch for that cache): bit-equal, since the same weight gives the same FP8
weight. And it is never stale: a training loop that never sets the flag quantizes at every
forward, a weight changed in place between micro-batches is quantized anew, and forwards
in flight together (pipeline parallelism) never overwrite what an earlier one saved."""

import contextlib

from helpers import dist

STEPS, MICRO = 3, 3


@contextlib.contextmanager
def _weight_casts(weights):
    """The casts of `weights` (layers.fp8.quantize_current's calls on them: the tensorwise
    casts), counted while inside."""
    from megatron_overlap.layers import fp8 as lf

    calls, real = [], lf.quantize_current
    ids = {id(w) for w in weights}

    def counting(x, *a, **k):
        if id(x) in ids:
            calls.append(id(x))
        return real(x, *a, **k)
    lf.quantize_current = counting
    try:
        yield calls
    finally:
        lf.quantize_current = real


def _schedule(rank, world):
    import torch

    import megatron_overlap as mo
    from helpers.gpt import make_config, make_model, train
    from helpers.megatron_cpu import init

    init(world)
    fp8 = dict(fp8="hybrid", fp8_recipe="tensorwise")
    mo.install()
    try:
        cached, wrap_cached = make_model(make_config(world, "gelu_bias", overlap=True, **fp8))
        plain, wrap_plain = make_model(make_config(world, "gelu_bias", overlap=True, **fp8,
                                                   disable_parameter_transpose_cache=True))
    finally:
        mo.uninstall()
    plain.load_state_dict(cached.state_dict())
    linears = lambda m: [x for x in m.modules() if hasattr(x, "_fp8_cache")]  # noqa: E731
    out = {}
    for name, model, wrap in (("cached", cached, wrap_cached), ("plain", plain, wrap_plain)):
        with _weight_casts([x.weight for x in linears(model)]) as calls:
            losses = train(wrap(model), steps=STEPS, schedule=True, microbatches=MICRO)
        out[name] = dict(losses=losses, casts=len(calls), linears=len(linears(model)),
                         caches=[x._fp8_cache is not None for x in linears(model)],
                         driven=[x._fp8_cache.driven for x in linears(model) if x._fp8_cache],
                         weights=[p.detach().clone() for p in model.parameters()])
    out["weights_equal"] = all(torch.equal(a, b) for a, b in zip(out["cached"].pop("weights"),
                                                                   out["plain"].pop("weights")))
    return out


def test_fp8_weights_are_made_once_per_step_under_megatrons_schedule():
    for r in dist.run(_schedule, 2, timeout=300):
        c, p = r["cached"], r["plain"]
        assert all(c["caches"]) and not any(p["caches"]), r
        assert c["losses"] == p["losses"] and r["weights_equal"], r  # bit-equal
        n = c["linears"]
        assert p["casts"] == n * STEPS * MICRO, r  # every forward
        # the first step cannot tell a schedule from a loop that never sets the flag (the
        # flag starts set): every forward; then once per step
        assert c["casts"] == n * (MICRO + STEPS - 1), r
        assert all(c["driven"]), r


def _loops(rank, world):
    import torch

    import megatron_overlap as mo
    from helpers import fp8_layers as fl
    from helpers.layers import VARIANTS
    from helpers.megatron_cpu import init

    init(world)
    case = fl.Fp8Case("column", "ring", True, "float32")
    overrides, flags = VARIANTS["column"]["ring"]
    w_r, b_r, x_r, dy_r = fl._shards(case, rank, world, *fl._whole(case, world, torch.float32))

    def fresh() -> dict:
        """A cached and an uncached layer, new, from the same weights."""
        mo.install(ub_cfgs=overrides)
        try:
            made = {k: fl.build("column", fl.config(world, True, torch.float32, flags, fp8="hybrid",
                                                     fp8_recipe="tensorwise",
                                                     disable_parameter_transpose_cache=k == "plain"))
                    for k in ("cached", "plain")}
        finally:
            mo.uninstall()
        for layer in made.values():
            with torch.no_grad():
                layer.weight.copy_(w_r)
                layer.bias.copy_(b_r)
        return made

    def run(layer, micro: list, weight=None) -> list:
        """Forwards of the micro-batches in `micro` (input scale factors) before any
        backward, as a pipeline stage keeps several in flight; then their backwards."""
        layer.weight.grad = None
        ys, xs = [], []
        for f in micro:
            x = (x_r * f).requires_grad_(True)
            y, _ = layer(x) if weight is None else layer(x, weight=weight)
            ys.append(y)
            xs.append(x)
        for y in ys:
            y.backward(dy_r)
        return [y.detach().clone() for y in ys] + [x.grad.clone() for x in xs] + [
            layer.weight.grad.clone() if weight is None else weight.grad.clone()]

    def same(update, set_flag, in_flight=1, supplied_first=False):
        """3 steps of 3 micro-batches (`in_flight` forwards before their backwards);
        `update(layer, step, micro)` changes the weight; `set_flag`: the schedule sets
        is_first_microbatch at each step's first; `supplied_first`: the last step's first
        micro-batch runs on a weight passed to the call instead of the layer's own."""
        results, layers = {}, fresh()
        for k, layer in layers.items():
            got = []
            other = layer.weight.detach().clone().mul_(3).requires_grad_(True)
            for s in range(3):
                m = 0
                while m < 3:
                    if set_flag and m == 0:
                        layer.is_first_microbatch = True
                    update(layer, s, m)
                    if supplied_first and m == 0 and s == 2:  # once the cache is in use
                        other.grad = None
                        got.append(run(layer, [1.0], weight=other))
                        m += 1
                        continue
                    n = min(in_flight, 3 - m)
                    got.append(run(layer, [1.0 + 0.5 * i for i in range(m, m + n)]))
                    m += n
            results[k] = got
        driven.append(layers["cached"]._fp8_cache.driven)
        return all(torch.equal(a, b) for ga, gb in zip(results["cached"], results["plain"])
                   for a, b in zip(ga, gb))

    def data_update(layer, s, m):  # as an optimizer that writes .data (no version bump)
        if m == 0 and s > 0:
            layer.weight.data.mul_(0.5)

    def in_place_mid_step(layer, s, m):  # changed between micro-batches: a new version
        if m == 1:
            with torch.no_grad():
                layer.weight.add_(0.25)

    driven: list = []
    out = {"never_set_data_updates": same(data_update, False),
           "schedule_data_updates": same(data_update, True),
           "schedule_in_place_mid_step": same(in_place_mid_step, True),
           "in_flight_first_step_and_after": same(data_update, True, in_flight=3),
           "in_flight_never_set": same(data_update, False, in_flight=2),
           "supplied_weight_takes_the_first": same(data_update, True, supplied_first=True)}
    return out, driven


def test_the_fp8_weight_cache_is_never_stale():
    """Bit-equal to quantizing at every forward: a loop that never sets the flag; updates
    at step boundaries with the flag set; a new version within a step; several micro-batches
    in flight before their backwards (a pipeline stage: the first step, whose forwards do
    not reuse, must not overwrite what earlier ones saved, nor may a step's first); a
    supplied weight taking a step's first micro-batch."""
    for r, driven in dist.run(_loops, 2, timeout=300):
        assert all(r.values()), r
        # the cache was in use where a schedule set the flag, and only there
        assert driven == [False, True, True, True, False, True], driven
