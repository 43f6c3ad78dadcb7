"""Multi-node TP without processes: the topology from what each rank reports, the
pairing of nodes, the ring order a setting and a topology give, the per-peer
transport's routing, and the `ring_order` key of the config."""

import re

import pytest
import torch

from megatron_overlap.comm import Topology
from megatron_overlap.comm.hierarchical import PerPeerTransport
from megatron_overlap.comm.null import NullTransport
from megatron_overlap.comm.topology import from_peers
from megatron_overlap.config import ConfigError, LayerSettings, OverlapConfig
from megatron_overlap.overlap.hierarchical import choose, pairing, partners


def _gpu(gid, reach, share=False):
    """A rank's device report: its GPU, which GPUs it reaches by P2P, may it share one."""
    return (gid, {g: g in reach or g == gid for g in ("g0", "g1", "g2", "g3")}, share)


# -- topology ------------------------------------------------------------------------------------
def test_cpu_nodes_by_key_in_group_order():
    t = from_peers(1, [("a", None), ("b", None), ("a", None), ("b", None)])  # interleaved
    assert (t.node, t.domain, t.local) == ((0, 1, 0, 1), (0, 1, 0, 1), (0, 0, 1, 1))
    assert t.nodes == ((0, 2), (1, 3)) and t.spans_nodes and t.is_hierarchical and t.uniform
    assert t.domain[3] == t.domain[t.rank] != t.domain[0] and t.describe() == "2 nodes x 2 ranks"
    u = from_peers(0, [("a", None), ("a", None), ("b", None)])
    assert not u.uniform and u.describe() == "2 nodes (2+1 ranks)"
    one = from_peers(0, [("a", None)] * 4)
    assert not one.is_hierarchical and one.describe() == "1 node x 4 ranks"


def test_gpu_domains_follow_p2p_access():
    full = [_gpu(g, {"g0", "g1", "g2", "g3"}) for g in ("g0", "g1", "g2", "g3")]
    assert from_peers(0, [("h", d) for d in full]).domains == ((0, 1, 2, 3),)
    pairs = [_gpu("g0", {"g1"}), _gpu("g1", {"g0"}), _gpu("g2", {"g3"}), _gpu("g3", {"g2"})]
    t = from_peers(2, [("h", d) for d in pairs])
    assert t.domains == ((0, 1), (2, 3)) and t.nodes == ((0, 1, 2, 3),)
    assert t.is_hierarchical and not t.spans_nodes and t.local == (0, 1, 0, 1)
    assert t.describe() == "1 node, 2 domains x 2 ranks"
    one_way = [_gpu("g0", {"g1"}), _gpu("g1", set())]  # access must go both ways
    assert from_peers(0, [("h", d) for d in one_way]).domains == ((0,), (1,))
    # two ranks on one GPU: one domain only where torch may map it twice
    assert from_peers(0, [("h", _gpu("g0", set()))] * 2).domains == ((0,), (1,))
    assert from_peers(0, [("h", _gpu("g0", set(), True))] * 2).domains == ((0, 1),)
    # GPUs of two nodes never share a domain, whatever the P2P rows say
    assert from_peers(0, [("a", full[0]), ("b", full[1])]).domains == ((0,), (1,))


# -- pairing and ring order -----------------------------------------------------------------------
@pytest.mark.parametrize("n", range(1, 8))
def test_pairing_rounds_are_mutual_and_meet_everyone_once(n):
    met = set()
    for row in pairing(n):
        for a, b in enumerate(row):
            if b is not None:
                assert row[b] == a and b != a
                met.add((a, b))
    assert met == {(a, b) for a in range(n) for b in range(n) if a != b}
    for a in range(n):
        assert sorted(partners(a, n)) == [b for b in range(n) if b != a]


def test_choose_ring_order():
    two = from_peers(0, [("a", None), ("a", None), ("b", None), ("b", None)])
    assert choose("auto", two).order == "hierarchical" and choose("auto", two).nodes == ((0, 1), (2, 3))
    assert choose("auto", two).label == "hierarchical (2x2)" and not choose("auto", two).note
    assert choose("flat", two).order == "flat" and choose("auto", None).order == "flat"
    one = from_peers(0, [("a", None)] * 4)
    assert choose("auto", one) == choose("flat", one)
    asked = choose("hierarchical", one)
    assert asked.order == "flat" and "inside one NVLink / P2P domain" in asked.note
    odd = from_peers(0, [("a", None), ("a", None), ("b", None)])
    fallback = choose("auto", odd)
    assert fallback.order == "flat" and "2 nodes (2+1 ranks)" in fallback.note
    assert "same number of TP ranks in every node" in fallback.note
    # one node of two P2P islands: auto keeps the flat ring, hierarchical asked uses them
    islands = Topology(0, (0, 0, 0, 0), (0, 0, 1, 1), (0, 1, 0, 1))
    assert choose("auto", islands).order == "flat"
    assert choose("hierarchical", islands).nodes == ((0, 1), (2, 3))


# -- per-peer routing ------------------------------------------------------------------------------
class _Recorder(NullTransport):
    def __init__(self, name, world, rank):
        super().__init__(world, rank)
        self.name, self.calls = name, []

    def _start_exchange(self, sends, recvs, op, chunk):
        self.calls.append(("exchange", [p for _, p, _ in sends], [p for _, p in recvs]))
        return super()._start_exchange(sends, recvs, op, chunk)

    def _start_all_gather(self, out, inp, op, chunk):
        self.calls.append(("all_gather",))
        return super()._start_all_gather(out, inp, op, chunk)

    def workspace(self, shape, dtype, device="cpu"):
        self.calls.append(("workspace",))
        return super().workspace(shape, dtype, device)


def test_per_peer_transport_routes_each_peer_and_traces_its_link():
    from megatron_overlap.comm import describe_peers, trace

    topo = from_peers(1, [("a", None), ("b", None), ("a", None), ("b", None)])  # rank 1: node b
    intra, inter = _Recorder("symm", 2, 0), _Recorder("torch_p2p", 4, 1)
    tp = PerPeerTransport(topo, intra, (1, 3), inter)  # the domain group: ranks 1, 3
    assert tp.peer_map() == {0: "inter:torch_p2p", 2: "inter:torch_p2p", 3: "intra:symm"}
    assert tp.transport_for_peer(3) is intra and tp.transport_for_peer(0) is inter
    assert tp.backends == ("symm", "torch_p2p") and describe_peers(tp) == \
        "inter:torch_p2p 0,2; intra:symm 3"
    assert tp.describe()["topology"] == "2 nodes x 2 ranks"
    t = torch.zeros(2)
    with trace.recording() as ev:
        tp.exchange([(t, 3), (t, 2)], [(t, 0), (t, 3)], op="ring", chunk=1).wait()
        tp.exchange([(t, 3)], [(t, 3)], op="ring", chunk=2).wait()
        tp.all_gather(torch.zeros(8), t, op="ag").wait()
    assert intra.calls == [("exchange", [1], [1])] * 2  # group rank 3 is rank 1 of the domain
    assert inter.calls == [("exchange", [2], [0]), ("all_gather",)]
    assert [(e.kind, e.chunk, e.via) for e in ev] == [
        ("start", 1, "inter:torch_p2p+intra:symm"), ("wait", 1, "inter:torch_p2p+intra:symm"),
        ("start", 2, "intra:symm"), ("wait", 2, "intra:symm"),
        ("start", 0, "inter:torch_p2p"), ("wait", 0, "inter:torch_p2p")]
    tp.workspace((2,), torch.float32)
    assert intra.calls[-1] == ("workspace",)  # receive buffers suit the intra transport


# -- the ring_order key ------------------------------------------------------------------------------
def test_ring_order_loads_validates_and_round_trips():
    cfg = OverlapConfig.load("qkv_fprop:\n  ring_order: hierarchical\nproj_fprop: {ring_order: flat}\n")
    assert cfg["qkv_fprop"].ring_order == "hierarchical" and cfg["proj_fprop"].ring_order == "flat"
    assert cfg["fc1_fprop"].ring_order == "auto" == LayerSettings.default("fc1_fprop").ring_order
    # TE's add_ub() takes its keys as keyword arguments: ours are written only when set
    assert "ring_order" not in OverlapConfig.load(None).to_dict()["qkv_fprop"]
    assert cfg.to_dict()["qkv_fprop"]["ring_order"] == "hierarchical"
    assert OverlapConfig.load(cfg.to_yaml()) == cfg
    assert cfg.replace("fc1_fprop", ring_order="flat")["fc1_fprop"].ring_order == "flat"
    with pytest.raises(ConfigError, match=re.escape(
            "layer 'fc2_dgrad', key 'ring_order': got 'hierarchial'; allowed: auto, flat, "
            "hierarchical (did you mean 'hierarchical'?)")) as info:
        OverlapConfig.load({"fc2_dgrad": {"ring_order": "hierarchial"}})
    assert (info.value.layer, info.value.key) == ("fc2_dgrad", "ring_order")
    with pytest.raises(ConfigError, match="key 'ring_order': got 2"):
        cfg.replace("qkv_fprop", ring_order=2)


def test_ring_order_in_the_effects_and_the_table():
    cfg = OverlapConfig.load({"qkv_fprop": {"ring_order": "hierarchical"}})
    assert cfg["qkv_fprop"].effects("symm")["ring_order"] == "active"
    assert cfg["qkv_dgrad"].effects("symm")["ring_order"] == "no effect: bulk runs no ring"
    text = cfg.table("torch_p2p", tp_size=8)
    line = next(x for x in text.splitlines() if x.startswith("Ring order:"))
    assert "hierarchical (inter-node transfers first) [qkv_fprop]" in line
    assert "auto (hierarchical where the TP group spans nodes, else flat)" in line


def test_plan_rows_merge_what_each_link_honours():
    from megatron_overlap.layers import LayerPlan
    from megatron_overlap.overlap.hierarchical import RingOrder

    s = LayerSettings.default("proj_fprop")  # pipeline, set_sm_margin on
    plan = LayerPlan("proj", "row", True, fprop=s)
    order = RingOrder("hierarchical", ((0, 1), (2, 3)), note="why")
    row, = plan.rows(4, "hierarchical", backends=("symm", "torch_p2p"), orders={"fprop": order},
                     transport="intra:symm 1; inter:torch_p2p 2-3")
    assert row["ring_order"] == "hierarchical (2x2)" and row["notes"] == "why"
    assert row["transport"] == "intra:symm 1; inter:torch_p2p 2-3"
    # num_sm holds the GEMM back on symm, but NCCL on the inter link picks its own SMs
    assert row["no_effect"]["num_sm"].startswith("no effect on torch_p2p")
    assert row["no_effect"]["num_splits"].startswith(
        "no effect: the hierarchical order reduces one row block")
    alone, = plan.rows(4, "symm")
    assert "num_sm" not in alone["no_effect"] and alone["ring_order"] == "-"
    assert "num_splits" not in alone["no_effect"]


def test_per_peer_transport_orders_a_send_after_an_arrival_through_the_other_transport():
    """A ring forwards what its last step received. Each transport orders its own
    exchanges; where a send goes through one transport and the last exchange received
    through the other (a flat ring at a node's edge; an aggregate ring's partner block sent
    on to rank + 2 on another node), the current stream waits for that arrival before the
    send starts, and not otherwise."""
    from megatron_overlap.comm import transport as transport_mod

    order = []

    class Handle(transport_mod.Handle):
        def __init__(self, name):
            self.name = name

        def wait(self):
            order.append(("wait", self.name))

    class Rec(_Recorder):
        def _start_exchange(self, sends, recvs, op, chunk):
            order.append(("start", self.name, chunk))
            return Handle(f"{self.name}{chunk}")

    topo = from_peers(1, [("a", None), ("b", None), ("a", None), ("b", None)])  # rank 1: node b
    intra, inter = Rec("symm", 2, 0), Rec("torch_p2p", 4, 1)
    tp = PerPeerTransport(topo, intra, (1, 3), inter)
    a, b, c, d, e = (torch.zeros(2) for _ in range(5))  # each step forwards what arrived
    tp.begin_pass("ring")
    tp.exchange([(a, 2)], [(b, 3)], op="ring", chunk=1)  # sends via inter, receives via intra
    tp.exchange([(b, 0)], [(c, 0)], op="ring", chunk=2)  # forwards via inter: waits intra's 1 first
    tp.exchange([(c, 0)], [(d, 2)], op="ring", chunk=3)  # inter only, after inter: no wait
    tp.exchange([(d, 3)], [(e, 3)], op="ring", chunk=4)  # forwards via intra: waits inter's 3 first
    t = e
    assert order == [("start", "torch_p2p", 1), ("start", "symm", 1), ("wait", "symm1"),
                     ("start", "torch_p2p", 2), ("start", "torch_p2p", 3), ("wait", "torch_p2p3"),
                     ("start", "symm", 4)], order
    order.clear()
    tp.begin_pass("next")  # a new pass forwards nothing of the last
    tp.exchange([(t, 0)], [(t, 0)], op="next", chunk=1)
    assert order == [("start", "torch_p2p", 1)]
    # a send of bytes that did not arrive (a reduce-scatter's partial) waits for nothing;
    # a view of what arrived through the other transport waits for it
    order.clear()
    tp.begin_pass("rs")
    part, slot, slot2 = torch.zeros(2), torch.zeros(2), torch.zeros(4)
    tp.exchange([(part, 2)], [(slot, 3)], op="rs", chunk=1)  # sends via inter, receives via intra
    tp.exchange([(torch.zeros(2), 0)], [(slot2, 0)], op="rs", chunk=2)  # other bytes: no wait
    tp.exchange([(slot2[2:], 3)], [], op="rs", chunk=3)  # forwards inter's arrival via intra
    tp.exchange([(torch.zeros(2), 3)], [], op="rs", chunk=4)  # intra: nothing of inter's
    tp.exchange([(slot, 0)], [], op="rs", chunk=5)  # intra's arrival of 3 exchanges ago, via inter
    assert order == [("start", "torch_p2p", 1), ("start", "symm", 1), ("start", "torch_p2p", 2),
                     ("wait", "torch_p2p2"), ("start", "symm", 3), ("start", "symm", 4),
                     ("wait", "symm1"), ("start", "torch_p2p", 5)], order


def test_a_torch_p2p_transfer_waited_on_twice_orders_both_waiters(monkeypatch):
    """A ring's GEMM stream waits for an arrival, and the per-peer transport waits for it
    again before forwarding it through its other transport. torch's works are waited on
    once (a gloo receive waited on again waits for another message); on a GPU the first
    wait orders its stream and records an event there, which every later wait's stream
    waits for (a handle that did nothing on its second wait left that stream, and so the
    forwarding send, unordered). CUDA's event and streams stood in for on CPU."""
    import torch

    from megatron_overlap.comm.torch_p2p import _Works

    class Work:
        def __init__(self):
            self.waits = 0

        def wait(self, timeout=None):
            self.waits += 1
            return True

    log = []

    class Event:
        def record(self):
            log.append(("record", stream[0]))

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_event(self, event):
            log.append(("wait_event", self.name, isinstance(event, Event)))

    stream = ["s1"]
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: Stream(stream[0]))
    for cuda in (False, True):
        works, log[:] = [Work(), Work()], []
        handle = _Works(works, timeout=None, cuda=cuda)
        stream[0] = "s1"
        handle.wait()
        stream[0] = "s2"
        handle.wait()
        assert [w.waits for w in works] == [1, 1]
        assert log == ([("record", "s1"), ("wait_event", "s2", True)] if cuda else [])

    class Silent(Work):
        def wait(self, timeout=None):
            return False  # torch's answer when the timeout passed

    with pytest.raises(TimeoutError):
        _Works([Silent()], timeout=1.0).wait()
