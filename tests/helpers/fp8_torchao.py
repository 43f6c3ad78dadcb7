"""Our FP8 layers against torchao's `Float8Linear` (tensorwise recipe: e4m3 input and
weight, e5m2 output gradient, all three GEMMs in FP8, dynamic per-tensor scales), on
the same whole weight, input and upstream gradient: torchao runs the whole layer on
one device; each of our TP ranks runs its shard, and is compared with the matching
slice of torchao's results. Both are also compared with the exact product (fp32 GEMMs
of the same params-dtype tensors), so a test can say how far each is from it."""

from __future__ import annotations

import torch

from megatron_overlap.ab.compare import rel_error

K, N = 256, 512  # the whole layer: column K -> N; row N -> K (per rank N / TP)
SEQ, BATCH = 32, 2  # per rank under SP




def _whole(kind: str, seq: int, device, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k_in, n_out = (K, N) if kind == "column" else (N, K)
    w = torch.randn(n_out, k_in, generator=g) / k_in ** 0.5
    x = torch.randn(seq, BATCH, k_in, generator=g) * 2
    dy = torch.randn(seq, BATCH, n_out, generator=g)
    return tuple(t.to(device, dtype) for t in (w, x, dy))


def _float8linear(w, x, dy) -> dict[str, torch.Tensor]:
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        lin.weight.copy_(w)
    f8 = Float8Linear.from_float(lin, config=Float8LinearConfig.from_recipe_name("tensorwise"))
    xi = x.reshape(-1, x.shape[-1]).clone().requires_grad_(True)
    y = f8(xi)
    y.backward(dy.reshape(y.shape))
    return {"output": y.detach(), "input_grad": xi.grad, "weight_grad": f8.weight.grad}


def _exact(w, x, dy) -> dict[str, torch.Tensor]:
    x2, g2, w32 = (t.reshape(-1, t.shape[-1]).float() for t in (x, dy, w))
    return {"output": x2 @ w32.t(), "input_grad": g2 @ w32, "weight_grad": g2.t() @ x2}


def _mine(kind: str, sp: bool, rank: int, tp: int, whole: dict[str, torch.Tensor]):
    """This rank's slice of each whole result (rows [tokens, features])."""
    rows = lambda t: t.chunk(tp)[rank] if sp else t  # noqa: E731  (SP: this rank's tokens)
    if kind == "column":
        return {"output": whole["output"].chunk(tp, dim=1)[rank],  # the whole sequence
                "input_grad": rows(whole["input_grad"]),
                "weight_grad": whole["weight_grad"].chunk(tp)[rank]}
    return {"output": rows(whole["output"]), "input_grad": whole["input_grad"].chunk(tp, dim=1)[rank],
            "weight_grad": whole["weight_grad"].chunk(tp, dim=1)[rank]}


def compare(rank: int, tp: int, kind: str, sp: bool, device, dtype=torch.bfloat16,
            ub_cfgs: dict | None = None) -> dict:
    """Our layer (fp8='hybrid', tensorwise; built under install(), so on a GPU with ranks
    sharing it the transport is symm) against Float8Linear: per result, the relative
    (norm) distance ours-torchao, ours-exact, torchao-exact; and what ran."""
    from megatron.core.transformer import TransformerConfig

    import megatron_overlap as mo
    from megatron_overlap.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear

    seq = SEQ * tp if sp else SEQ
    w, x, dy = _whole(kind, seq, device, dtype)
    cfg = TransformerConfig(num_layers=1, hidden_size=K, num_attention_heads=4,
                            tensor_model_parallel_size=tp, sequence_parallel=sp,
                            tp_comm_overlap=True, use_cpu_initialization=True, params_dtype=dtype,
                            fp8="hybrid", fp8_recipe="tensorwise")
    init = lambda t: torch.nn.init.zeros_(t)  # noqa: E731
    mo.install(ub_cfgs=ub_cfgs)
    try:
        if kind == "column":
            layer = OverlapColumnParallelLinear(K, N, config=cfg, init_method=init, bias=False,
                                                gather_output=False, tp_comm_buffer_name="qkv")
        else:
            layer = OverlapRowParallelLinear(N, K, config=cfg, init_method=init, bias=False,
                                             input_is_parallel=True, skip_bias_add=False,
                                             tp_comm_buffer_name="proj")
    finally:
        mo.uninstall()
    layer = layer.to(device)
    with torch.no_grad():
        layer.weight.copy_(w.chunk(tp)[rank] if kind == "column" else w.chunk(tp, dim=1)[rank])
    x_r = (x.chunk(tp)[rank] if sp else x) if kind == "column" else x.chunk(tp, dim=-1)[rank]
    dy_r = dy.chunk(tp, dim=-1)[rank] if kind == "column" else (dy.chunk(tp)[rank] if sp else dy)
    xi = x_r.contiguous().clone().requires_grad_(True)
    y, _ = layer(xi)
    y.backward(dy_r.contiguous())
    flat = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    ours = {"output": flat(y.detach()), "input_grad": flat(xi.grad), "weight_grad": layer.weight.grad}
    ao = _mine(kind, sp, rank, tp, _float8linear(w, x, dy))
    exact = _mine(kind, sp, rank, tp, _exact(w, x, dy))
    out = {"precision": layer.precision.describe(), "transport": layer.transport.name,
           "megatron_forward": layer._use_megatron}
    for key in ours:
        assert ours[key].shape == ao[key].shape, (key, ours[key].shape, ao[key].shape)
        out[key] = {"ours_ao": rel_error(ours[key], ao[key]), "ours_exact": rel_error(ours[key], exact[key]),
                    "ao_exact": rel_error(ao[key], exact[key]), "dtype": str(ours[key].dtype)}
    return out
