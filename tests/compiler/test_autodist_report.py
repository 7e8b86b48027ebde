"""plan_report.md beside the generated code, and `python -m nnscaler.plan` (offline planning)."""

from __future__ import annotations

import json

from nnscaler import ComputeConfig
from nnscaler.cli.plan import main
from nnscaler.parallel.compile import compile_module
from nnscaler.policies import Plan
from tests import zoo

TP_CLUSTER = {
    "device": {"name": "cpu", "fp32_tflops": 0.01, "mem_bw_gbs": 1e6, "kernel_overhead_us": 0},
    "devices_per_node": 8,
    "intra_node": {"bandwidth_gbs": 100, "latency_us": 10},
}


def test_compile_writes_plan_report(tmp_path):
    model, make_batch = zoo.build("llama")
    cfg = ComputeConfig(2, 4, pas_config={"cluster": TP_CLUSTER})
    compile_module(model, make_batch(0, 4), "autodist", cfg, tmp_path, "test")
    report = (tmp_path / "plan_report.md").read_text()
    assert "Chosen: pp=1 tp=2" in report and "x2 data-parallel" in report
    # per module: layer 0 split Megatron-style (column q/k/v, row o_proj and down_proj)
    row = next(line for line in report.splitlines() if line.startswith("| model.layers.0 |"))
    assert "linear:k x2" in row and "linear:n x5" in row and "scaled_dot_product_attention:g x1" in row
    assert "| **total** |" in report
    recipes = report.split("## Standard recipes")[1]
    assert "DP x4 + ZeRO-1" in recipes and "Megatron TP2 x PP1 x DP2" in recipes
    # the comparison with the best recipe that fits carries the model's error on published runs
    assert "than the best recipe that fits (" in recipes and "error against published runs" in recipes
    assert "gencode0.py" in {p.name for p in tmp_path.iterdir()}


def test_tp_policy_writes_no_report(tmp_path):
    model, make_batch = zoo.build("mlp")
    compile_module(model, make_batch(0, 4), "tp", ComputeConfig(2, 2), tmp_path, "test")
    assert not (tmp_path / "plan_report.md").exists()


def test_plan_cli_prints_report_without_compiling(tmp_path, capsys):
    out, plan_path = tmp_path / "report.md", tmp_path / "plan.json"
    args = [
        "--model",
        "tests.zoo.build_gpt",
        "--cluster",
        "h100x8",
        "--out",
        str(out),
        "--save-plan",
        str(plan_path),
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# Plan report (autodist)") and "## Configurations searched" in printed
    assert out.read_text() == printed
    table = printed.split("## Standard recipes")[1]
    auto_ms = float(table.split("| **autodist:")[1].split("|")[2])
    recipe_ms = [
        float(line.split("|")[2]) for line in table.splitlines() if line.startswith(("| DP", "| Megatron"))
    ]
    assert recipe_ms and auto_ms <= min(recipe_ms) * (1 + 1e-9)  # never worse than a standard recipe
    saved = json.loads(plan_path.read_text())
    assert Plan.from_json(json.dumps(saved["plan"])).policy == "autodist"
    assert not list(tmp_path.rglob("gencode*.py"))


def _recipe_row(report: str, name: str) -> str:
    table = report.split("## Standard recipes")[1]
    return next(line for line in table.splitlines() if line.startswith(f"| {name}"))


def _step_ms(row: str) -> float:
    return float(row.split("|")[2])


def test_faster_recipe_names_the_user_constraint_that_excludes_it(tmp_path):
    # recompute_modules makes the plan recompute both decoder layers; Megatron TP2 (same plan size, no
    # recompute) is faster and must say that recompute_modules is what rules it out
    model, make_batch = zoo.build("llama")
    pas = {"cluster": TP_CLUSTER, "recompute_modules": "LlamaDecoderLayer"}
    compile_module(model, make_batch(0, 4), "autodist", ComputeConfig(2, 4, pas_config=pas), tmp_path, "test")
    report = (tmp_path / "plan_report.md").read_text()
    chosen = _step_ms(_recipe_row(report, "**autodist:"))
    row = _recipe_row(report, "Megatron TP2 x PP1 x DP2")
    assert _step_ms(row) < chosen
    why = row.split("|")[5]
    assert "recompute_modules" in why and "model.layers.0" in why and "plan_ngpus" not in why
    # data parallel plans over one device: the ComputeConfig's plan size rules it out too
    dp_row = _recipe_row(report, "DP x4 + ZeRO-1")
    assert _step_ms(dp_row) < chosen and "plan_ngpus=2" in dp_row and "recompute_modules" in dp_row
    # every faster recipe gives a reason; slower ones give none
    table = report.split("## Standard recipes")[1].split("\n\n")[0]
    for line in table.splitlines()[3:]:
        assert (line.split("|")[5].strip() != "") == (_step_ms(line) < chosen), line


def _llama_setup(**pas):
    from nnscaler.graph.capture import capture
    from nnscaler.policies import make_plan
    from nnscaler.policies.autodist.policy import planner_setup

    model, make_batch = zoo.build("llama")
    graph = capture(model, make_batch(0, 4), both_modes=False)
    cfg = ComputeConfig(2, 4, pas_config={"cluster": TP_CLUSTER, **pas})
    return graph, make_plan(graph, "autodist", cfg), planner_setup(graph, cfg)


def test_faster_recipe_excluded_by_memory_names_its_peak_and_the_limit():
    from nnscaler.policies.autodist.report import plan_report

    # 1 MB per device: the search recomputes its layers to fit; data parallel with ZeRO-1 keeps every
    # weight and does not fit even recomputed, so its (faster, unrecomputed) row is ruled out by memory
    graph, plan, setup = _llama_setup(mem_constraint=1e-3)
    report = plan_report(graph, plan, setup)
    chosen = _step_ms(_recipe_row(report, "**autodist:"))
    row = _recipe_row(report, "DP x4 + ZeRO-1")
    assert "| no |" in row and _step_ms(row) < chosen
    assert "does not fit memory:" in row and "limit 0.001 GB" in row


def test_recipe_exclusions_name_pipeline_and_partition_constraints():
    from dataclasses import replace

    from nnscaler.policies.autodist.recipes import standard_recipes
    from nnscaler.policies.autodist.report_reasons import why_not_taken

    rule = {"name": "linear", "parent_module": "lm_head", "allowed_partition_dims": []}
    graph, _, setup = _llama_setup(pipeline_nstages=1, partition_constraints=[rule])
    recipes = {r.name: r for r in standard_recipes(graph, replace(setup, end2end=True), 4)}
    tp2 = recipes["Megatron TP2 x PP1 x DP2"]
    assert any("partition constraint on linear in lm_head" in e and "splits it" in e for e in tp2.excluded)
    pp = next(r for n, r in recipes.items() if "PP2" in n)
    assert any("pipeline_nstages=1; it has 2 stage(s)" in e for e in pp.excluded)
    # a recipe nothing excludes says so honestly
    free = replace(recipes["DP x4 + ZeRO-1"], excluded=())
    assert why_not_taken(free, setup)[0].startswith("not considered by the search: no recorded reason")


def test_splits_in_words_name_each_axis_and_where_it_lies():
    from nnscaler.graph.capture import capture
    from nnscaler.policies import make_plan
    from nnscaler.policies.autodist.policy import planner_setup
    from nnscaler.policies.autodist.report import plan_report
    from tests.mesh2d_policy import build_token_ffn

    # 2 nodes x 2 devices: neighbours share a node, a 2 x 2 mesh's axis 0 crosses nodes
    cluster = {
        "device": "cpu",
        "nodes": 2,
        "devices_per_node": 2,
        "intra_node": {"bandwidth_gbs": 1.0, "latency_us": 1},
        "inter_node": {"bandwidth_gbs": 0.5, "latency_us": 2},
    }
    model, make_batch = build_token_ffn()
    graph = capture(model, make_batch(0, 4), both_modes=False)
    for cfg, expect in [
        (
            ComputeConfig(4, 4, pas_config={"cluster": cluster, "tp_mesh": [2, 2]}),
            ["axis 0 (2, inter-node)", "axis 1 (2, intra-node)"],
        ),
        (
            ComputeConfig(2, 4, pas_config={"cluster": cluster}),
            ["tp (2, intra-node)", "batch over dp (2, inter-node)"],
        ),
    ]:
        plan = make_plan(graph, "autodist", cfg)
        words = plan_report(graph, plan, planner_setup(graph, cfg)).split("## Splits in words")[1]
        words = words.split("## Standard recipes")[0]
        up = next(line for line in words.splitlines() if line.startswith("- `ups.0`"))
        assert "linear output features" in up and all(e in words for e in expect), words
        assert all(e in up for e in expect[1:] if "dp" in e)
    assert plan.mesh == () and "axis 0" not in words


def test_folded_layers_read_once_in_words(tmp_path):
    model, make_batch = zoo.build("llama")
    compile_module(
        model,
        make_batch(0, 4),
        "autodist",
        ComputeConfig(2, 4, pas_config={"cluster": TP_CLUSTER}),
        tmp_path,
        "t",
    )
    words = (tmp_path / "plan_report.md").read_text().split("## Splits in words")[1].split("## Standard")[0]
    layers = next(line for line in words.splitlines() if "model.layers.0" in line)
    assert "`model.layers.0` ... `model.layers.1` (2 alike)" in layers
    assert "attention key/value head groups" in layers and "over tp (2, intra-node)" in layers


def test_pipelined_plan_report_gives_each_stage_its_share(tmp_path):
    model, make_batch = zoo.build("llama")
    cfg = ComputeConfig(2, 2, use_end2end=True, pas_config={"cluster": TP_CLUSTER, "pipeline_nstages": 2})
    compile_module(model, make_batch(0, 4), "autodist", cfg, tmp_path, "test")
    report = (tmp_path / "plan_report.md").read_text()
    stages = report.split("## Pipeline stages")[1].split("\n## ")[0]
    rows = [line for line in stages.splitlines() if line.startswith("| 0 |") or line.startswith("| 1 |")]
    assert len(rows) == 2, stages
    flops = [float(r.split("|")[3].strip().rstrip("%")) for r in rows]
    assert abs(sum(flops) - 100) < 0.5 and min(flops) > 25, stages  # two layers: about half each
