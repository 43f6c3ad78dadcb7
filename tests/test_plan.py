"""Megatron's tp_comm_* flags, with TE's meaning, mapped onto each layer's passes."""

from types import SimpleNamespace

import pytest

from megatron_overlap.config import OverlapConfig
from megatron_overlap.layers import build_plan

CFG, CFG_RS = OverlapConfig.load(None), OverlapConfig.load(None, rs_dgrad=True)


def flags(**kw):
    base = dict(tp_comm_overlap=True, tp_comm_overlap_ag=True, tp_comm_overlap_rs=True,
                tp_comm_bulk_dgrad=True, tp_comm_bulk_wgrad=True, tp_comm_overlap_rs_dgrad=False,
                tp_comm_overlap_disable_qkv=False, tp_comm_overlap_disable_fc1=False)
    return SimpleNamespace(**{**base, **kw})


def plan(config, buf, kind, sp=True, expert=False, settings=CFG, ring_n=1024):
    return build_plan(config, buf, kind, sequence_parallel=sp, is_expert=expert,
                      settings=settings, rs_dgrad_settings=CFG_RS, ring_n=ring_n)


def names(p):
    return tuple(s.name if s else None for s in (p.fprop, p.dgrad, p.wgrad))


def test_defaults_overlap_every_pass_with_te_methods():
    assert names(plan(flags(), "qkv", "column")) == ("qkv_fprop", "qkv_dgrad", "qkv_wgrad")
    assert names(plan(flags(), "fc2", "row")) == ("fc2_fprop", "fc2_dgrad", "fc2_wgrad")
    p = plan(flags(), "fc1", "column")
    assert (p.fprop.method, p.dgrad.method, p.wgrad.method) == ("ring_exchange", "bulk", "bulk")


def test_master_switch_off_experts_and_unnamed_buffers_run_megatron():
    assert not plan(flags(tp_comm_overlap=False), "qkv", "column").enabled
    assert not plan(flags(), "qkv", "column", expert=True).enabled
    assert not plan(flags(), None, "row").enabled


def test_each_flag_turns_off_its_passes():
    assert names(plan(flags(tp_comm_overlap_ag=False), "qkv", "column")) == (None, "qkv_dgrad", "qkv_wgrad")
    assert names(plan(flags(tp_comm_overlap_ag=False), "proj", "row")) == ("proj_fprop", None, None)
    assert names(plan(flags(tp_comm_overlap_rs=False), "proj", "row")) == (None, "proj_dgrad", "proj_wgrad")
    assert names(plan(flags(tp_comm_bulk_dgrad=False), "fc1", "column")) == ("fc1_fprop", None, "fc1_wgrad")
    assert names(plan(flags(tp_comm_bulk_wgrad=False), "fc1", "column")) == ("fc1_fprop", "fc1_dgrad", None)


def test_disable_qkv_and_fc1_turn_off_ag_and_rs_dgrad_only_for_that_layer():
    f = flags(tp_comm_overlap_disable_qkv=True, tp_comm_overlap_rs_dgrad=True)
    q = plan(f, "qkv", "column")
    assert q.fprop is None and not q.rs_dgrad and q.dgrad.method == "bulk"
    fc1 = plan(f, "fc1", "column")
    assert fc1.fprop is not None and fc1.rs_dgrad and fc1.dgrad.method != "bulk" and fc1.wgrad is None
    assert plan(flags(tp_comm_overlap_disable_fc1=True), "fc1", "column").fprop is None


def test_without_sequence_parallel_only_the_all_reduces_overlap():
    assert names(plan(flags(), "qkv", "column", sp=False)) == (None, None, "qkv_wgrad")
    assert names(plan(flags(), "proj", "row", sp=False)) == ("proj_fprop", None, None)


def test_bad_buffer_names_and_contradictory_settings_are_clear_errors():
    with pytest.raises(ValueError, match="tp_comm_buffer_name='attn'.*qkv"):
        plan(flags(), "attn", "column")
    with pytest.raises(ValueError, match="column-parallel but its buffer 'proj'"):
        plan(flags(), "proj", "column")
    cfg = OverlapConfig.load({"qkv_dgrad": {"method": "pipeline"}, "qkv_wgrad": None})
    with pytest.raises(ValueError, match="qkv_dgrad has method 'pipeline'.*tp_comm_overlap_rs_dgrad"):
        plan(flags(), "qkv", "column", settings=cfg)


def test_a_ring_exchange_that_runs_as_a_pipeline_is_reported(caplog):
    from megatron_overlap.layers import plan as plan_module

    plan_module._warned.clear()
    ring = OverlapConfig.load({"proj_fprop": {"method": "ring_exchange"}})
    with caplog.at_level("WARNING", logger="megatron_overlap"):
        row = plan(flags(), "proj", "row", sp=False, settings=ring)
        plan(flags(), "proj", "row", sp=False, settings=ring)  # every layer of a model: once
    said = [r.getMessage() for r in caplog.records if "runs as a pipeline" in r.getMessage()]
    assert said == ["megatron_overlap: proj_fprop: method ring_exchange runs as a pipeline of "
                    "TP-size chunked all-reduces (an all-reduce has no ring schedule)"]  # the log
    assert any("proj_fprop: method ring_exchange runs as a pipeline" in n for n in row.notes)
    shown = row.rows(4, "symm")
    assert shown and "runs as a pipeline" in shown[0]["notes"]  # the settings table and wandb
    assert not any("runs as a pipeline" in n for n in plan(flags(), "proj", "row", settings=ring).notes)


def test_bulk_says_what_it_hides_under():
    """ub_cfgs' bulk exists only on the column backward and means hidden under another
    GEMM; the rows (console table, wandb) and the settings table say under which."""
    rows = {r["pass"]: r for r in plan(flags(), "fc1", "column").rows(4, "symm")}
    assert rows["dgrad"]["method"] == rows["wgrad"]["method"] == "bulk"
    assert "fc1_dgrad: bulk: the saved input's all-gather (for the wgrad) runs whole under " \
        "the dgrad GEMM" in rows["dgrad"]["notes"]
    assert "fc1_wgrad: bulk: the dgrad's reduce-scatter" in rows["wgrad"]["notes"]
    assert "under the wgrad GEMM" in rows["wgrad"]["notes"]
    assert "bulk" not in rows["fprop"]["notes"]
    table = CFG.table("symm", tp_size=4)
    line = next(x for x in table.splitlines() if x.startswith("bulk ("))
    assert "hidden under another GEMM of the backward, not unoverlapped" in line
    assert "under the dgrad GEMM [qkv_dgrad, fc1_dgrad]" in line
    assert "under the wgrad GEMM [qkv_wgrad, fc1_wgrad]" in line
    none = OverlapConfig.load({"qkv_dgrad": {"method": "pipeline"}, "fc1_dgrad": {"method": "pipeline"}},
                              rs_dgrad=True)
    assert not any(x.startswith("bulk (") for x in none.table("symm").splitlines())


def test_a_pass_the_plan_leaves_plain_is_named_for_its_layer():
    """On symm every pass opens the transport's pass with a barrier, also a pass that
    overlaps nothing (a column forward without SP): a peer missing there is reported under
    the layer's pass name, not a bare 'fprop'."""
    column = plan(flags(), "qkv", "column", sp=False)
    assert column.fprop is None and column.op_name("fprop") == "qkv_fprop"
    assert column.op_name("wgrad") == column.wgrad.name == "qkv_wgrad"
    row = plan(flags(), "proj", "row", sp=False)
    assert row.dgrad is None and row.op_name("dgrad") == "proj_dgrad"


def test_aggregate_on_an_odd_tp_size_is_refused_at_build():
    """`aggregate` pairs a ring's ranks (overlap.ring_steps): an odd TP size is refused
    naming the layer, the pass and the fix; an even one builds."""
    agg = OverlapConfig.load({"qkv_fprop": {"method": "ring_exchange", "aggregate": 1},
                              "proj_dgrad": {"method": "ring_exchange", "aggregate": 1}})
    for buf, kind, name in (("qkv", "column", "qkv_fprop"), ("proj", "row", "proj_dgrad")):
        with pytest.raises(ValueError, match=f"{name} has aggregate=1.*TP size is 3.*aggregate: 0 "
                                             r"\(or auto\)"):
            plan(flags(tensor_model_parallel_size=3), buf, kind, settings=agg)
        p = plan(flags(tensor_model_parallel_size=4), buf, kind, settings=agg)
        assert (p.fprop if kind == "column" else p.dgrad).aggregate


@pytest.mark.parametrize("buf,kind,name", [("qkv", "column", "qkv_fprop"), ("fc1", "column", "fc1_fprop"),
                                           ("proj", "row", "proj_dgrad"), ("fc2", "row", "fc2_dgrad")])
def test_aggregate_auto_pairs_the_ring_where_its_gemm_outlasts_a_transfer(buf, kind, name):
    """The default, `aggregate: auto`, runs TE's pairs on a ring all-gather whose GEMM has
    AGGREGATE_MIN_N columns a rank or more, at an even TP > 2 (one node: the layer's topology
    is not known at build), and says which it chose and why in the layer's notes; a given
    true or false is kept whatever N is."""
    from megatron_overlap.config.names import AGGREGATE_MIN_N

    def ring(p):
        return p.fprop if kind == "column" else p.dgrad
    for tp, n, pairs in ((8, AGGREGATE_MIN_N, True), (8, AGGREGATE_MIN_N - 128, False),
                         (4, 7168, True), (2, 7168, False), (6, 7168, True), (3, 7168, False)):
        p = plan(flags(tensor_model_parallel_size=tp), buf, kind, ring_n=n)
        assert ring(p).aggregate is pairs, (tp, n)
        assert p.auto_pairs == ((ring(p).pass_name,) if pairs else ())
        said = [x for x in p.notes if x.startswith(f"{name}: aggregate auto")]
        if tp == 2:  # the pairs are the plain ring: nothing to say
            assert not said
            continue
        assert len(said) == 1 and ("pairs" in said[0]) is pairs, said
        assert ("odd" in said[0]) is (tp % 2 == 1), said
        assert tp % 2 or f"its GEMM's {n} columns a rank" in said[0], said
        row = next(r for r in p.rows(tp, "symm") if r["settings"] == name)
        assert row["aggregate"] is pairs and said[0] in row["notes"]
    for given in (True, False):
        cfg = OverlapConfig.load({name: {"method": "ring_exchange", "aggregate": given}})
        for n in (1024, 7168):
            p = plan(flags(tensor_model_parallel_size=8), buf, kind, settings=cfg, ring_n=n)
            assert ring(p).aggregate is given and p.auto_pairs == ()
            assert not any("aggregate auto" in x for x in p.notes)


def test_aggregate_auto_rings_plain_where_a_flat_ring_spans_nodes():
    """Pairs chosen at build are taken back once the layer finds its flat ring across nodes
    (`plain_across_nodes`, at the first forward): blocks then cross the network."""
    p = plan(flags(tensor_model_parallel_size=16), "fc1", "column", ring_n=7168)
    assert p.fprop.aggregate is True and p.auto_pairs == ("fprop",)
    q = p.plain_across_nodes(["fprop"])
    assert q.fprop.aggregate is False and q.auto_pairs == ()
    assert [x for x in q.notes if "aggregate auto" in x] == [
        "fc1_fprop: aggregate auto: plain ring (its flat ring spans nodes)"]
    assert q.dgrad == p.dgrad and q.wgrad == p.wgrad and p.plain_across_nodes([]) is p
