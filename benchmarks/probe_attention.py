"""What torch's fused attention offers on this GPU and torch, before choosing paths.

Prints, for one TP rank of a 70B model (8 query heads, 1 key/value group, head dim 128,
bf16), forward + backward times of the candidate kernels (CUDA events, median of
`--reps`), and which features each one takes: SDPA with GQA (`enable_gqa`), with a
boolean mask, with `causal_lower_right`; torch's varlen attention (its signature here:
GQA, window, dropout?); FlexAttention with a causal and a document mask; and what each
gives for a query row whose every key is masked. Writes the table to `--out` (JSON).

    python benchmarks/probe_attention.py --out benchmarks/results/probe_attention_h200.json
"""

from __future__ import annotations

import argparse
import inspect
import json

import torch
import torch.nn.functional as F

from megatron_overlap.tune.measure import time_ms


def timed(fn, reps: int) -> float:
    """Median ms per call (CUDA events), after three calls."""
    return time_ms(fn, reps, warmup=3)


def fwd_bwd(run, *tensors):
    def step():
        for t in tensors:
            t.grad = None
        out = run()
        out.backward(torch.ones_like(out))
    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="benchmarks/results/probe_attention.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    res: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    try:
        from torch.nn.attention import varlen
        res["varlen_signature"] = str(inspect.signature(varlen.varlen_attn))
    except Exception as e:  # noqa: BLE001
        res["varlen_signature"] = f"missing: {type(e).__name__}: {e}"
        varlen = None
    from torch.nn.attention.bias import causal_lower_right
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    times: dict = {}
    for s, b in ((4096, 2), (16384, 1)):
        q = torch.randn(b, 8, s, 128, device=dev, dtype=dt, requires_grad=True)
        k = torch.randn(b, 1, s, 128, device=dev, dtype=dt, requires_grad=True)
        v = torch.randn(b, 1, s, 128, device=dev, dtype=dt, requires_grad=True)
        row: dict = {}
        row["sdpa causal gqa"] = timed(fwd_bwd(lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True), q, k, v), args.reps)
        row["sdpa causal_lower_right gqa"] = timed(fwd_bwd(lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=causal_lower_right(s, s), enable_gqa=True), q, k, v), args.reps)
        mask = torch.ones(s, s, device=dev, dtype=torch.bool).tril()
        try:
            row["sdpa bool mask gqa"] = timed(fwd_bwd(lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, enable_gqa=True), q, k, v), args.reps)
        except Exception as e:  # noqa: BLE001
            row["sdpa bool mask gqa"] = f"{type(e).__name__}: {str(e)[:200]}"
        row["sdpa causal gqa dropout0.1"] = timed(fwd_bwd(lambda: F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True, dropout_p=0.1), q, k, v), args.reps)
        bm = create_block_mask(lambda b_, h, i, j: i >= j, None, None, s, s, device=dev)
        flex = torch.compile(flex_attention)
        row["flex causal gqa"] = timed(fwd_bwd(lambda: flex(q, k, v, block_mask=bm, enable_gqa=True),
                                               q, k, v), args.reps)
        if varlen is not None:
            t = b * s
            qt = q.detach().transpose(1, 2).reshape(t, 8, 128).requires_grad_()
            kt = k.detach().transpose(1, 2).reshape(t, 1, 128).requires_grad_()
            vt = v.detach().transpose(1, 2).reshape(t, 1, 128).requires_grad_()
            for docs in (1, 4):
                cu = torch.arange(0, t + 1, s // docs, device=dev, dtype=torch.int32)
                kw = {}
                params = inspect.signature(varlen.varlen_attn).parameters
                if "enable_gqa" in params:
                    kw["enable_gqa"] = True
                kw["window_size" if "window_size" in params else "is_causal"] = (
                    (-1, 0) if "window_size" in params else True)
                try:
                    row[f"varlen causal gqa {docs} docs/seq"] = timed(fwd_bwd(
                        lambda cu=cu, kw=kw: varlen.varlen_attn(qt, kt, vt, cu, cu, s // docs, s // docs, **kw),
                        qt, kt, vt), args.reps)
                except Exception as e:  # noqa: BLE001
                    row[f"varlen causal gqa {docs} docs/seq"] = f"{type(e).__name__}: {str(e)[:200]}"
            doc = s // 4
            dm = create_block_mask(lambda b_, h, i, j: (i >= j) & (i // doc == j // doc), None, None,
                                   s, s, device=dev)
            row["flex causal 4 docs/seq"] = timed(fwd_bwd(
                lambda: flex(q, k, v, block_mask=dm, enable_gqa=True), q, k, v), args.reps)
        times[f"seq {s} x {b}"] = row
        del q, k, v, mask
        torch.cuda.empty_cache()
    res["ms fwd+bwd"] = times
    # a query row whose every key is masked
    q = torch.randn(1, 2, 4, 16, device=dev, dtype=dt)
    m = torch.ones(1, 1, 4, 4, device=dev, dtype=torch.bool)
    m[..., 0, :] = False
    res["fully masked row"] = {}
    for name, be in (("math", torch.nn.attention.SDPBackend.MATH),
                     ("efficient", torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION),
                     ("cudnn", torch.nn.attention.SDPBackend.CUDNN_ATTENTION)):
        try:
            with torch.nn.attention.sdpa_kernel(be):
                o = F.scaled_dot_product_attention(q, q, q, attn_mask=m)
            res["fully masked row"][name] = o[0, 0, 0].float().tolist()[:3]
        except Exception as e:  # noqa: BLE001
            res["fully masked row"][name] = f"{type(e).__name__}: {str(e)[:120]}"
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
