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
