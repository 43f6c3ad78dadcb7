"""The compact settings table (what `make demo` prints): one line per linear and pass,
layers with the same settings on one line, keys that do nothing anywhere named once,
and nothing that changes what runs (a fallback, a differing layer) folded away.
Rows are built as the layers build them (OverlapConfig's settings and effects)."""

from megatron_overlap.config import OverlapConfig
from megatron_overlap.telemetry import compact_table, settings_table

MODULES = {"qkv": "self_attention.linear_qkv", "proj": "self_attention.linear_proj",
           "fc1": "mlp.linear_fc1", "fc2": "mlp.linear_fc2"}


def _rows(config: OverlapConfig, layers: int, backend: str = "torch_p2p",
          tp: int = 2) -> list[dict]:
    rows = []
    for n in range(layers):
        for name in config:
            buffer, pass_name = name.split("_")
            if name in config.unused_layers:
                continue
            s = config[name]
            effects = config.effects(name, backend)
            rows.append({"module": f"decoder.layers.{n}.{MODULES[buffer]}", "layer_number": n,
                         "layer": buffer, "settings": name, "pass": pass_name, "method": s.method,
                         "buffer_bytes": 1024, "num_splits": s.splits(tp), "num_sm": s.num_sm,
                         "use_ce": s.use_ce, "aggregate": s.aggregates(1024, tp), "backend": backend,
                         "ring_order": "flat" if s.method in ("ring_exchange", "pipeline") else "-",
                         "transport": backend,
                         "no_effect": {k: v for k, v in effects.items() if v != "active"},
                         "notes": f"{name}: bulk: hides under {pass_name}" if s.method == "bulk"
                         else ""})
    passes = ("fprop", "dgrad", "wgrad")
    rows.sort(key=lambda r: (r["layer_number"], r["module"], passes.index(r["pass"])))
    return rows


def test_alike_layers_share_a_line_and_idle_keys_are_one_legend_line():
    rows = _rows(OverlapConfig.load(None), layers=4)
    out = compact_table(rows)
    lines = out.splitlines()
    assert len(rows) == 48 and len(lines) < 30, out
    body = [line for line in lines if line.startswith(" 0-3") or line.startswith("    ")]
    assert sum(line.split()[0] == "0-3" for line in body) == 4, out  # one label per linear
    # layer order through the block: qkv, proj, fc1, fc2
    at = [out.index(MODULES[b]) for b in ("qkv", "proj", "fc1", "fc2")]
    assert at == sorted(at), out
    legend = next(line for line in lines if line.startswith("No effect on any pass here:"))
    for key in ("num_sm", "use_ce", "cga_size", "atomic_gemm", "fp8_buf"):  # NCCL picks these
        assert key in legend, legend
    header = lines[2].split()
    assert "num_sm" not in header and "use_ce" not in header and "aggregate" in header, header
    assert "bulk: hides under dgrad [qkv_dgrad, fc1_dgrad]" in out, out  # once, naming the passes
    assert max(map(len, lines)) <= 160
    assert "decoder.layers.3.mlp.linear_fc1" in settings_table(rows)  # the full one keeps all


def test_a_layer_that_differs_and_a_clamped_key_are_shown():
    rows = _rows(OverlapConfig.load(None), layers=2)
    odd = OverlapConfig.load({"fc1_fprop": {"method": "ring_exchange", "aggregate": 1,
                                            "gemm_priority": 1}})
    rows += [dict(r, layer_number=2, module=r["module"].replace("layers.1.", "layers.2."))
             for r in _rows(odd, layers=2) if r["layer_number"] == 1]
    lines = compact_table(rows).splitlines()
    fc1 = lines.index(next(line for line in lines if MODULES["fc1"] in line))
    assert lines[fc1].split()[:4] == ["0-1", MODULES["fc1"], "fprop", "ring_exchange"], lines
    assert "no" in lines[fc1].split()  # aggregate off on layers 0-1
    # layer 2's fprop has a line of its own (aggregate on); its backward is layers 0-2's
    assert lines[fc1 + 1].split()[:4] == ["2", "fprop", "ring_exchange", "2"], lines
    assert "yes" in lines[fc1 + 1].split(), lines
    assert lines[fc1 + 2].split()[:2] == ["0-2", "dgrad"], lines
    clamp = [line for line in lines if line.startswith("gemm_priority: clamped")]
    assert clamp and clamp[0].endswith("[fc1_fprop]"), lines  # what changes a run: never folded
    legend = next(line for line in lines if line.startswith("No effect on any pass here:"))
    assert "gemm_priority" not in legend, legend
