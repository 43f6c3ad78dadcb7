"""Megatron's own CUDA graphs over the overlapped layers, ranks sharing one GPU
(symm transport): a megatron-core GPTModel with tp_comm_overlap=True and Megatron's
local graphs (its CudaGraphManager; `cuda_graph_impl="local"`, `enable_cuda_graph`
before 0.16) trains 12 steps through Megatron's schedule. Its transformer layers
are captured (after Megatron's warmup steps) and replayed, our per-pass graphs stand
aside, and every step's loss equals the same model trained eagerly.

Megatron's full-iteration scope is not run here: it captures Megatron's own
collectives too (embedding and loss reductions over TP), which on ranks sharing a
GPU go through gloo and cannot be captured; it needs one GPU per rank (NCCL)."""

import pytest

from helpers import dist, gpu

STEPS, WARMUP = 12, 2


def _graph_settings() -> dict:
    from megatron.core.transformer import TransformerConfig

    fields = TransformerConfig.__dataclass_fields__
    cfg = {"cuda_graph_impl": "local"} if "cuda_graph_impl" in fields else {"enable_cuda_graph": True}
    if "cuda_graph_warmup_steps" in fields:
        cfg["cuda_graph_warmup_steps"] = WARMUP
    return cfg


def _train(rank, world, variant):
    import torch

    import megatron_overlap as mo
    from helpers.gpt import make_config, make_model, train
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron_overlap.comm import stats

    gpu.init()
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    model_parallel_cuda_manual_seed(1234, use_cudagraphable_rng=True)  # Megatron's graphs need it
    torch.manual_seed(1234)
    mo.install(backend="auto")
    try:
        eager, wrap_eager = make_model(make_config(world, variant, overlap=True))
        graphed, wrap_graphed = make_model(make_config(world, variant, overlap=True, **_graph_settings()))
    finally:
        mo.uninstall()
    eager.cuda(), graphed.cuda()
    graphed.load_state_dict(eager.state_dict())

    moved = []  # per step: transfers our layers' Python issued (0 once Megatron replays)

    def note(step):
        moved.append(sum(s["transfers"] for s in stats.snapshot().values()))

    stats.snapshot()
    losses_eager = train(wrap_eager(eager), steps=STEPS, device="cuda", schedule=True)
    stats.snapshot()
    losses_graphed = train(wrap_graphed(graphed), steps=STEPS, device="cuda", schedule=True,
                           after_step=note)
    torch.cuda.synchronize()
    runners = [r for layer in graphed.decoder.layers
               for r in getattr(getattr(layer, "cudagraph_manager", None), "cudagraph_runners", [])]
    ours = [m for m in graphed.modules() if hasattr(m, "pass_graphs")]
    return dict(
        losses=(losses_eager, losses_graphed), moved=moved,
        graphs=sum(getattr(r, "fwd_graph", None) is not None for r in runners),
        bwd_graphs=sum(getattr(r, "bwd_graph", None) is not None for r in runners),
        layers=len(graphed.decoder.layers), transports={m.transport.name for m in ours},
        ours_captured=sum(g.captures for m in ours for g in m.pass_graphs.values()),
        ours_off={g.off for m in ours for g in m.pass_graphs.values()})


@pytest.mark.parametrize("world,variant", [(2, "gelu_bias"), (4, "swiglu_gqa_rms")])
def test_megatron_local_cuda_graphs_over_overlapped_layers(world, variant):
    for r in dist.run(_train, world, variant, env=gpu.ENV, timeout=500):
        print(r)
        eager, graphed = r["losses"]
        assert r["transports"] == {"symm"}
        assert graphed == pytest.approx(eager, rel=1e-6, abs=0)
        # every transformer layer captured by Megatron, forward and backward
        assert r["graphs"] >= r["layers"] and r["bwd_graphs"] >= r["layers"], r
        # eager warmup steps ran our passes; the replayed steps issued nothing from Python
        assert r["moved"][0] > 0 and r["moved"][-3:] == [0, 0, 0], r["moved"]
        assert r["ours_captured"] == 0 and all(r["ours_off"]), r
