"""The drop-in contract beyond the numbers: constructor keywords, parameter
attributes, state-dict and sharded-state-dict keys, main_grad accumulation, the
layer-level overlap order, install()/uninstall(), and clear errors."""

import inspect

import pytest

from helpers import dist


def _api_checks(rank, world):
    import torch
    from megatron.core import ModelParallelConfig, parallel_state
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    import megatron_overlap as mo
    from helpers.layers import Case, build, make_input, rel
    from helpers.megatron_cpu import init
    from megatron_overlap.comm import trace
    from megatron_overlap.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear

    init(world)
    out = {}
    # -- every keyword Megatron's constructors take is accepted, plus `name`
    cfg = ModelParallelConfig(tensor_model_parallel_size=world, sequence_parallel=True,
                              use_cpu_initialization=True, tp_comm_overlap=True)
    init_m = torch.nn.init.xavier_normal_
    col = OverlapColumnParallelLinear(
        8, 16, config=cfg, init_method=init_m, bias=True, gather_output=False, stride=1,
        keep_master_weight_for_test=False, skip_bias_add=True, skip_weight_param_allocation=False,
        embedding_activation_buffer=None, grad_output_buffer=None, is_expert=False,
        tp_comm_buffer_name="fc1", disable_grad_reduce=False,
        tp_group=parallel_state.get_tensor_model_parallel_group(), name="decoder.layers.0.mlp.linear_fc1")
    row = OverlapRowParallelLinear(
        16, 8, config=cfg, init_method=init_m, bias=True, input_is_parallel=True, skip_bias_add=False,
        stride=1, keep_master_weight_for_test=False, is_expert=False, tp_comm_buffer_name="fc2",
        tp_group=parallel_state.get_tensor_model_parallel_group(), name="decoder.layers.0.mlp.linear_fc2")
    ref_col = ColumnParallelLinear(8, 16, config=cfg, init_method=init_m, bias=True,
                                   gather_output=False, skip_bias_add=True, tp_comm_buffer_name="fc1")
    ref_row = RowParallelLinear(16, 8, config=cfg, init_method=init_m, bias=True,
                                input_is_parallel=True, skip_bias_add=False, tp_comm_buffer_name="fc2")
    attrs = ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel", "allreduce")
    for label, ours, ref in (("column", col, ref_col), ("row", row, ref_row)):
        out[f"{label}_state_keys"] = (sorted(ours.state_dict()), sorted(ref.state_dict()))
        meta = {"dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
        s_ours = ours.sharded_state_dict(prefix="l.", metadata=meta)
        s_ref = ref.sharded_state_dict(prefix="l.", metadata=meta)
        desc = lambda sd: {k: (type(v).__name__, v.key, tuple(v.global_shape),  # noqa: E731
                               tuple(getattr(v, "global_offset", ()))) for k, v in sd.items()}
        out[f"{label}_sharded"] = (desc(s_ours), desc(s_ref))
        out[f"{label}_attrs"] = (
            {n: {a: getattr(p, a, None) for a in attrs} for n, p in ours.named_parameters()},
            {n: {a: getattr(p, a, None) for a in attrs} for n, p in ref.named_parameters()})
        out[f"{label}_shapes"] = ({n: tuple(p.shape) for n, p in ours.named_parameters()},
                                  {n: tuple(p.shape) for n, p in ref.named_parameters()})
    out["overlap_names"] = (col.overlap_plan.layer, row.overlap_plan.layer)

    # -- the layer-level order: ring AG in fprop, bulk AG under dgrad, bulk RS under wgrad
    x = torch.randn(4, 2, 8, requires_grad=True)
    with trace.recording() as ev:
        y, _ = col(x)
        y.backward(torch.randn_like(y))
    out["column_trace"] = [(e.kind, e.op, e.chunk) for e in ev]
    xr = torch.randn(4 * world, 2, 16 // world, requires_grad=True)
    with trace.recording() as ev:
        y, _ = row(xr)
        y.backward(torch.randn_like(y))
    out["row_trace"] = [(e.kind, e.op, e.chunk) for e in ev]

    # -- gradient_accumulation_fusion without apex: main_grad += dW, like Megatron with apex
    case = Case("column", True, "float32", True, False, "ring")
    ref = build(case, world, overlap=False)
    mo.install()
    try:
        ours = build(case, world, overlap=True, gradient_accumulation_fusion=True)
    finally:
        mo.uninstall()
    ours.load_state_dict(ref.state_dict())
    start = torch.randn(ours.weight.shape)
    ours.weight.main_grad = start.clone()
    x = make_input(case, rank, world, ref)
    for layer in (ref, ours):
        y, _ = layer(x.detach().clone().requires_grad_(True))
        y.backward(torch.ones_like(y))
    out["main_grad_err"] = rel(ours.weight.main_grad, start + ref.weight.grad)
    out["main_grad_weight_grad"] = ours.weight.grad

    # -- a token count that num_splits does not divide names the layer and the fix
    mo.install({"proj_fprop": {"method": "pipeline", "num_splits": 4}})
    try:
        bad = build(Case("row", True, "float32", True, False, "pipeline4"), world, overlap=True)
    finally:
        mo.uninstall()
    try:
        bad(torch.randn(3 * world, 1, 24 // world))
        out["split_error"] = "no error"
    except ValueError as exc:
        out["split_error"] = str(exc)
    return out


@pytest.fixture(scope="module")
def api():
    return dist.run(_api_checks, 2)[0]


def test_state_dict_and_sharded_keys_match_megatron(api):
    for label in ("column", "row"):
        ours, ref = api[f"{label}_state_keys"]
        assert ours == ref
        ours, ref = api[f"{label}_sharded"]
        assert ours == ref and ours
        ours, ref = api[f"{label}_shapes"]
        assert ours == ref


def test_parameter_attributes_match_megatron(api):
    for label in ("column", "row"):
        ours, ref = api[f"{label}_attrs"]
        assert ours == ref
    assert api["row_attrs"][0]["bias"]["sequence_parallel"] is True
    assert api["column_attrs"][0]["weight"]["partition_dim"] == 0
    assert api["column_attrs"][0]["weight"]["allreduce"] is True


def test_name_keyword_is_used_in_diagnostics(api):
    assert api["overlap_names"] == ("decoder.layers.0.mlp.linear_fc1", "decoder.layers.0.mlp.linear_fc2")


def test_layer_forward_and_backward_overlap_order(api):
    col = api["column_trace"]
    # fprop ring at TP=2: start(1) gemm(0) wait(1) gemm(1)
    assert col[:4] == [("start", "fc1_fprop", 1), ("gemm", "fc1_fprop", 0),
                       ("wait", "fc1_fprop", 1), ("gemm", "fc1_fprop", 1)]
    # backward: the input all-gather hides under dgrad, the grad reduce-scatter under wgrad
    assert col[4:] == [("start", "fc1_dgrad", 0), ("gemm", "fc1_dgrad", 0), ("wait", "fc1_dgrad", 0),
                       ("start", "fc1_wgrad", 0), ("gemm", "fc1_wgrad", 0), ("wait", "fc1_wgrad", 0)]
    row = api["row_trace"]
    # fprop pipeline (TE default, num_splits 4 -> rows per rank 8 / 4): each RS under the next GEMM
    fprop = [e for e in row if e[1] == "fc2_fprop"]
    for i in range(3):
        assert fprop.index(("start", "fc2_fprop", i)) < fprop.index(("gemm", "fc2_fprop", i + 1))
    # dgrad ring-exchange all-gather of the output grad, then wgrad on the gathered grad
    dgrad = [e for e in row if e[1] == "fc2_dgrad"]
    assert dgrad == [("start", "fc2_dgrad", 1), ("gemm", "fc2_dgrad", 0), ("wait", "fc2_dgrad", 1),
                     ("gemm", "fc2_dgrad", 1)]
    assert row[-1] == ("gemm", "fc2_wgrad", 0)  # "external": no transfer of its own


def test_gradient_accumulation_fusion_accumulates_into_main_grad(api):
    assert api["main_grad_err"] < 1e-5
    assert api["main_grad_weight_grad"] is None  # Megatron's convention without grad_added_to_main_grad


def test_rows_that_do_not_split_name_layer_and_fix(api):
    msg = api["split_error"]
    assert "proj_fprop" in msg and "num_splits" in msg, msg


def test_constructor_accepts_every_megatron_keyword():
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    from megatron_overlap.layers import OverlapColumnParallelLinear, OverlapRowParallelLinear

    for ours, ref in ((OverlapColumnParallelLinear, ColumnParallelLinear),
                      (OverlapRowParallelLinear, RowParallelLinear)):
        assert issubclass(ours, ref)
        params = inspect.signature(ours.__init__).parameters
        assert any(p.kind is p.VAR_KEYWORD for p in params.values())  # the rest go to Megatron
        assert "name" in params and "tp_comm_buffer_name" in params


def test_install_uninstall_restore_previous_state():
    import megatron_overlap as mo
    from megatron_overlap.config import state

    assert not state.installed()
    first = mo.install({"proj_fprop": {"num_splits": 2}})
    assert state.current().settings["proj_fprop"].num_splits == 2
    mo.install({"proj_fprop": {"num_splits": 8}})
    assert state.current().settings["proj_fprop"].num_splits == 8
    mo.uninstall()
    assert state.current().settings == first
    mo.uninstall()
    assert not state.installed()
    mo.uninstall()  # extra uninstall is a no-op


def test_install_rejects_unknown_backend_and_layer():
    import megatron_overlap as mo
    from megatron_overlap.config import ConfigError

    with pytest.raises(ValueError, match="unknown backend 'nccl2'"):
        mo.install(backend="nccl2")
    with pytest.raises(ConfigError, match="qkv_fprp"):
        mo.install({"qkv_fprp": {"method": "ring_exchange"}})
    from megatron_overlap.config import state
    assert not state.installed()
