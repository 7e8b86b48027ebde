"""How long autodist takes on this machine, and how good the plan is (issue 42's targets: Llama-3-8B on
8 H100 as `python -m nnscaler.plan` plans it, <= 30 s end to end; Llama-3-405B at 16K on 2,048 H100
(256 nodes) with pipelines, meshes, cp and ZeRO searched, <= 60 s end to end; each plan's predicted
step at most 0.79 / 0.87 of the best standard recipe's, as the report computes it).

Prints one JSON object per row: seconds per phase (trace, the search of every outer choice: plan size x
ZeRO stage x micro-batches, the report, the standard recipes), the end-to-end total, the plan /
best-recipe ratio, the ILP sizes and the chosen configuration. Models are built from their configs on
the meta device and traced as the CLI traces them (the module's own mode; sizes fixed, as without
--at / --save-plan).

    python benchmarks/plan_time.py [--rows 8b-plan,8b-compile,70b-plan,405b-plan] [--layers N]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from benchmarks.plan_quality import _llama, cluster_spec, llama3_405b_16k
from nnscaler import ComputeConfig
from nnscaler.graph.capture import capture
from nnscaler.parallel.compile import compile_module
from nnscaler.policies.autodist import load_cluster
from nnscaler.policies.autodist.cp_search import evaluate_any_plan
from nnscaler.policies.autodist.offline import plan_offline
from nnscaler.policies.autodist.recipes import standard_recipes
from nnscaler.policies.autodist.report import plan_report


def _report_ratio(report: str) -> dict:
    """The plan's predicted step over the best fitting recipe's, read from a plan report's tables."""
    step = float(re.search(r"Predicted step: ([\d.]+) ms", report).group(1))
    table = report.split("## Standard recipes", 1)[-1]
    fits = [
        (float(m.group(2)), m.group(1))
        for m in re.finditer(r"^\| ([^|*][^|]*) \| ([\d.]+) \| [\d.]+ \| yes \|", table, re.M)
    ]
    best = min(fits) if fits else (float("nan"), "none fits")
    return {
        "step_ms": step,
        "best_recipe": best[1],
        "best_recipe_ms": best[0],
        "vs_best_recipe": round(step / best[0], 3),
    }


def compile_8b(layers: int | None) -> dict:
    model, inputs = _llama(layers, 8192, 1)
    cfg = ComputeConfig(8, 8, pas_config={"cluster": "h100x8", "use_bf16": True})
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = compile_module(model, inputs, "autodist", cfg, Path(tmp), "bench")
        report = (Path(tmp) / "plan_report.md").read_text()
    total = time.perf_counter() - t0
    return {
        "row": "llama3-8b compile, autodist, 8x H100",
        "nodes": len(result.graph.nodes),
        "total_s": round(total, 1),
        "stages_s": {k: round(v, 2) for k, v in result.seconds.items()},
        "report_lines": len(report.splitlines()),
        **_report_ratio(report),
        "target_s": 30,
    }


def _offline_row(row: str, model, inputs, cluster, devices: int | None, target_s: float) -> dict:
    """Trace, plan offline, report and recipes, each timed, as `python -m nnscaler.plan` does them."""
    t0 = time.perf_counter()
    graph = capture(model, inputs, static_shapes=True, both_modes=False)
    trace_s = time.perf_counter() - t0
    result = plan_offline(graph, cluster, devices, pas_config={"use_bf16": True})
    setup, plan = result.setup, result.plan
    t1 = time.perf_counter()
    plan_report(graph, plan, setup, result.scored, recipes=False)
    report_s = time.perf_counter() - t1
    t2 = time.perf_counter()
    cand = evaluate_any_plan(graph, setup, plan)  # as the report's recipes table does
    recipes = standard_recipes(graph, setup, setup.plan_ngpus * setup.dp_size, cand.nmicros)
    recipes_s = time.perf_counter() - t2
    fitting = [r for r in recipes if r.fits]
    best = min(fitting, key=lambda r: r.candidate.step_time) if fitting else None
    total = trace_s + result.seconds + report_s + recipes_s
    return {
        "row": row,
        "nodes": len(graph.nodes),
        "trace_s": round(trace_s, 1),
        "search_s": round(result.seconds, 1),
        "report_s": round(report_s, 1),
        "recipes_s": round(recipes_s, 1),
        "total_s": round(total, 1),
        "target_s": target_s,
        "search_per_outer_choice_s": {k: round(v, 2) for k, v in result.phases},
        "chosen": result.best.label() + f" plan_ngpus={setup.plan_ngpus}",
        "mesh": list(plan.mesh),
        "step_ms": round(cand.step_time * 1e3, 3),
        "best_recipe": best.name if best else "none fits",
        "best_recipe_ms": round(best.candidate.step_time * 1e3, 3) if best else None,
        "vs_best_recipe": round(cand.step_time / best.candidate.step_time, 3) if best else None,
        "ilp": result.best.spmd.stats,
        "configurations": len(result.scored),
    }


def plan_8b(layers: int | None) -> dict:
    """`python -m nnscaler.plan --hf-config llama8b.json --seq 8192 --cluster h100x8 --bf16` (batch 4)."""
    model, inputs = _llama(layers, 8192, 4)
    return _offline_row(
        "llama3-8b offline plan, 8x H100 (the CLI)", model, inputs, load_cluster("h100x8"), None, 30
    )


def plan_70b(layers: int | None) -> dict:
    model, inputs = _llama(layers, 8192, 64, 8192, 28672, 64, 8, 80)
    return _offline_row(
        "llama3-70b offline plan, 64x H100 (8 nodes)", model, inputs, load_cluster("h100x64_ib"), 64, 60
    )


def plan_405b(layers: int | None) -> dict:
    model, inputs = llama3_405b_16k(layers)
    return _offline_row(
        "llama3-405b 16K offline plan, 2048x H100 (256 nodes), pipelines, meshes, cp and ZeRO searched",
        model,
        inputs,
        cluster_spec("h100x2048_ib"),
        2048,
        60,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8b-plan,8b-compile,405b-plan")
    ap.add_argument("--layers", type=int, default=None)
    args = ap.parse_args()
    rows = {"8b-plan": plan_8b, "8b-compile": compile_8b, "70b-plan": plan_70b, "405b-plan": plan_405b}
    for name in args.rows.split(","):
        print(json.dumps(rows[name](args.layers), default=str), flush=True)


if __name__ == "__main__":
    main()
