"""benchmarks/published_runs.yaml and its loader (issue 42): enough rows and sources, both splits,
every row valid, a broken row refused; the harness's metric conversions against hand computations."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import yaml

from benchmarks.cost_model_vs_published import cluster_of, predicted_figure, summary
from benchmarks.published_runs import DEFAULT_PATH, load_rows


def test_the_table_has_15_rows_from_5_sources_and_a_spread_held_aside_split():
    rows = load_rows()
    assert len(rows) >= 15
    assert len({r.source["name"] for r in rows}) >= 5
    held = [r for r in rows if r.split == "held_aside"]
    assert len(held) >= 5 and any(r.split == "calibrate" for r in rows)
    assert len({r.source["name"] for r in held}) >= 3
    assert {r.hardware["device"] for r in held} >= {"a100", "h100"}
    assert load_rows(split="held_aside") == held


def _doc():
    return yaml.safe_load(DEFAULT_PATH.read_text())


@pytest.mark.parametrize(
    "path, words",
    [
        (("layout", "micro_batch"), "micro_batch"),
        (("published", "kind"), "kind"),
        (("model", "hidden"), "hidden"),
        (("split",), "split"),
    ],
)
def test_a_row_missing_a_field_is_refused_naming_it(tmp_path, path, words):
    doc = copy.deepcopy(_doc())
    target = doc["rows"][3]
    for key in path[:-1]:
        target = target[key]
    del target[path[-1]]
    f = tmp_path / "runs.yaml"
    f.write_text(yaml.safe_dump(doc))
    with pytest.raises(ValueError, match=rf"{doc['rows'][3]['id']}.*{words}"):
        load_rows(f)


def test_a_layout_that_does_not_multiply_to_the_gpus_is_refused(tmp_path):
    doc = copy.deepcopy(_doc())
    doc["rows"][0]["layout"]["dp"] += 1
    f = tmp_path / "runs.yaml"
    f.write_text(yaml.safe_dump(doc))
    with pytest.raises(ValueError, match="tp x pp x dp x cp"):
        load_rows(f)


def _row(ident):
    return next(r for r in load_rows() if r.id == ident)


def test_tokens_per_second_per_gpu_from_a_step_time():
    run = _row("lf_mpt7b_h100_8")  # 48 sequences of 2048 on 8 GPUs
    assert predicted_figure(run, 2.0, 0) == pytest.approx(48 * 2048 / (2.0 * 8))


def test_megatron_hardware_tflops_count_the_recompute_forward():
    run = _row("sc21_gpt3_175b_1024")  # B 1536, s 2048, l 96, h 12288, V 51200, 1024 GPUs
    b, s, n, h, v = 1536, 2048, 96, 12288, 51200
    flops = 96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h))
    assert predicted_figure(run, 10.0, 0) == pytest.approx(flops / (10.0 * 1024) / 1e12)


def test_llama3_mfu_uses_6n_plus_attention_against_the_datasheet_peak():
    run = _row("llama3_405b_8k_8192")
    p, n, h, s, b = 405e9, 126, 16384, 8192, 2048
    want = (6 * p + 12 * n * h * s) * b * s / (5.0 * 8192 * 989e12)
    assert predicted_figure(run, 5.0, int(p)) == pytest.approx(want)


def test_a_rows_cluster_carries_its_power_cap_and_memory():
    dev = cluster_of(_row("tt_llama31_8b_h100_8")).device
    assert dev.power_w == 500 and dev.memory_gb == 96 and dev.mem_bw_gbs == 2400
    assert dev.tflops("bfloat16") < 989


def test_summary_gives_median_and_worst_error_per_split():
    rows = [
        {"split": "held_aside", "ratio": 1.1},
        {"split": "held_aside", "ratio": 0.95},
        {"split": "held_aside", "ratio": 1.0},
        {"split": "calibrate", "ratio": 0.8},
    ]
    out = {s["summary"]: s for s in summary(rows)}
    assert out["held_aside"]["median_error"] == pytest.approx(0.05)
    assert out["held_aside"]["worst_error"] == pytest.approx(0.1)
    assert out["calibrate"]["worst_error"] == pytest.approx(0.2)


def _tiny(**layout):
    """A published-run row of a tiny Llama (built and captured in a second) with `layout` changed."""
    base = _row("tt_llama3_8b_a100_64")
    model = {
        "family": "llama",
        "hidden": 64,
        "layers": 4,
        "heads": 4,
        "kv_heads": 2,
        "ffn": 128,
        "vocab": 256,
    }
    hardware = {**base.hardware, "gpus": 8, "nodes": 1}
    lay = {**base.layout, "dp": 8, "global_batch": 16, "micro_batch": 2, **layout}
    return replace(base, id="tiny", model=model, hardware=hardware, layout=lay, seq=32)


def test_selective_op_recompute_is_costed_halfway_between_none_and_full():
    from benchmarks.cost_model_vs_published import Captures, cost_row

    captures = Captures()
    graph, _ = captures.get(_tiny())
    steps = {k: cost_row(_tiny(recompute=k), graph)[0].step_time for k in ("none", "full", "selective_op")}
    assert steps["full"] > steps["none"]
    assert steps["selective_op"] == pytest.approx((steps["none"] + steps["full"]) / 2)


def test_an_interleaved_row_gets_pp_times_vpp_stages():
    from benchmarks.cost_model_vs_published import Captures, cost_row

    row = _tiny(tp=2, pp=2, dp=2, global_batch=8, micro_batch=1, zero=0)
    graph, _ = Captures().get(row)
    plain = cost_row(row, graph)[0]
    inter = cost_row(replace(row, layout={**row.layout, "vpp": 2, "scheduler": "1f1b_interleaved"}), graph)[0]
    assert len(plain.starts) == 2 and len(inter.starts) == 4
    assert inter.step_time != plain.step_time
