"""The Python side of one overlapped layer call on the replay path, on CPU.

On the GPU a replayed call costs the layer's own bookkeeping, autograd, the output's
allocation, one graph launch and the watchdog's event (`host_time.py`). This measures
the first three without a GPU, so changes to them can be weighed on any machine: the
public layers (TP=1 group over gloo, tiny shapes) with each pass's CUDA graph replaced
by a stand-in whose replay does nothing; everything around it (`PassGraphs.run`'s
signature, checks, stats) runs as it does on the GPU. The pass itself runs once, at
its capture (the stand-in keys graphs without addresses, which on the GPU recur from
step to step: see its `_key`). Host µs per call, median of --reps blocks of --calls calls.

    python benchmarks/host_python.py [--calls 2000] [--reps 5] [--profile] [--precision bf16,fp8]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


class _NoGraph:
    def replay(self) -> None:
        pass


def _stand_in_graphs(name: str):
    """A layer's PassGraphs whose captures run the pass once and whose replays do nothing."""
    from megatron_overlap.overlap import replay

    class StandIn(replay.PassGraphs):
        def _usable(self, tp, tensors) -> bool:
            return True

        def _key(self, tp, tensors, static):
            # the real signature is made (its cost counts), then addresses are left out of
            # the key: the CPU allocator, unlike CUDA's caching one, rarely hands an output
            # its last address again, and a call that misses would run the pass itself
            super()._key(tp, tensors, static)
            return tuple(None if t is None else (t.shape, t.dtype) for t in tensors) + static

        def _capture(self, tp, body):
            before = replay.stats.snapshot(reset=False)
            body()
            self.captures += 1
            return replay._Graph(_NoGraph(), (), replay.taken_back(before), "stand-in")

    return StandIn(name)


FP8 = dict(fp8="hybrid", fp8_recipe="tensorwise")


def build(hidden: int, fp8: bool = False):
    """qkv (column) and proj (row) of one layer at TP=1, overlap on, passes stood in;
    `fp8`: with Megatron's FP8 fields (the FP8 passes' host side: their operands'
    allocation and signature)."""
    import megatron_overlap as mo
    from megatron.core.transformer import TransformerConfig

    mo.install(None, backend="torch_p2p")
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    cfg = TransformerConfig(num_layers=1, hidden_size=hidden, num_attention_heads=4,
                            tensor_model_parallel_size=1, sequence_parallel=False,
                            tp_comm_overlap=True, use_cpu_initialization=True,
                            gradient_accumulation_fusion=False, **(FP8 if fp8 else {}))
    init = torch.nn.init.xavier_normal_
    layers = {"qkv": ColumnParallelLinear(hidden, 3 * hidden, config=cfg, init_method=init,
                                          bias=False, skip_bias_add=True, gather_output=False,
                                          tp_comm_buffer_name="qkv"),
              "proj": RowParallelLinear(hidden, hidden, config=cfg, init_method=init, bias=False,
                                        skip_bias_add=True, input_is_parallel=True,
                                        tp_comm_buffer_name="proj")}
    for name, layer in layers.items():
        assert layer.overlap_plan.enabled, name
        layer.pass_graphs = {p: _stand_in_graphs(f"{name} {p}") for p in ("fprop", "bwd")}
    return layers


def measure(layer, x, g, calls: int, reps: int) -> dict[str, float]:
    for _ in range(20):  # capture, then replays only
        layer(x)[0].backward(g)
    fwd, bwd = [], []
    for _ in range(reps):  # forward then backward, as a step runs one layer (its addresses recur)
        f = b = 0.0
        for _ in range(calls):
            t0 = time.perf_counter()
            y = layer(x)[0]
            t1 = time.perf_counter()
            y.backward(g)
            f, b = f + t1 - t0, b + time.perf_counter() - t1
        fwd.append(f * 1e6 / calls)
        bwd.append(b * 1e6 / calls)
    replays = {p: pg.replays for p, pg in layer.pass_graphs.items()}
    return {"fwd_us": statistics.median(fwd), "bwd_us": statistics.median(bwd), "replays": replays}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--profile", action="store_true", help="cProfile of the forwards (own time)")
    ap.add_argument("--precision", default="bf16,fp8",
                    help="comma list: bf16 (the parameters' dtype), fp8 (hybrid, tensorwise)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # megatron-core on CPU: the tests' shims
    from helpers.dist import _free_port
    from helpers.megatron_cpu import init

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0",
                      WORLD_SIZE="1")
    init(1)
    arms = {p: build(args.hidden, fp8=p == "fp8") for p in args.precision.split(",")}
    print(f"host µs per call, Python side of the replay path (CPU, torch {torch.__version__}, "
          f"median of {args.reps} x {args.calls} calls; 16 tokens)")
    for name in ("qkv", "proj"):  # each layer's arms one after the other
        for precision, layers in arms.items():
            layer = layers[name]
            x = torch.randn(16, 1, layer.input_size, requires_grad=True)  # (FP8 wgrad: 16 | tokens)
            g = torch.randn(16, 1, layer.output_size_per_partition if name == "qkv" else layer.output_size)
            r = measure(layer, x, g, args.calls, args.reps)
            print(f"{precision:4s} {name:5s} fwd {r['fwd_us']:6.1f}  bwd {r['bwd_us']:6.1f}  "
                  f"replays {r['replays']}")
            if args.profile:
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.calls):
                    layer(x)
                prof.disable()
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(12)
                print(out.getvalue())

if __name__ == "__main__":
    main()
