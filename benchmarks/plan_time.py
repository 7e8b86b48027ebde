"""How long autodist takes on this machine (issue 12's targets: Llama-3-8B whole compile with the
search on 8 H100 under 30 s; Llama-3-70B on 64 H100 with the pipeline search under 60 s; issue 28's:
Llama-3-405B at 16K on 2,048 H100 (256 nodes) with pipelines and meshes searched under 60 s, torch's
trace reported apart).

Prints JSON: seconds per stage, the ILP sizes (binaries, continuous, constraints, folded nodes), the
chosen configuration. Models are built from their configs on the meta device.

    python benchmarks/plan_time.py [--rows 8b-compile,70b-plan,405b-plan] [--layers N]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from benchmarks.plan_quality import _llama, cluster_spec, llama3_405b_16k
from nnscaler import ComputeConfig
from nnscaler.graph.capture import capture
from nnscaler.parallel.compile import compile_module
from nnscaler.policies.autodist import load_cluster, planner_setup, search
from nnscaler.policies.autodist.offline import plan_offline


def compile_8b(layers: int | None) -> dict:
    model, inputs = _llama(layers, 8192, 1)
    cfg = ComputeConfig(8, 8, pas_config={"cluster": "h100x8", "use_bf16": True})
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = compile_module(model, inputs, "autodist", cfg, Path(tmp), "bench")
        report = (Path(tmp) / "plan_report.md").read_text()
    total = time.perf_counter() - t0
    setup = planner_setup(result.graph, cfg)
    t1 = time.perf_counter()
    best, scored = search(result.graph, setup)
    search_s = time.perf_counter() - t1
    return {
        "row": "llama3-8b compile, autodist, 8x H100",
        "nodes": len(result.graph.nodes),
        "total_s": round(total, 1),
        "stages_s": {k: round(v, 2) for k, v in result.seconds.items()},
        "search_s": round(search_s, 2),
        "ilp": best.spmd.stats,
        "chosen": best.label(),
        "report_lines": len(report.splitlines()),
        "target_s": 30,
    }


def _offline_row(row: str, model, inputs, cluster, devices: int) -> dict:
    """Trace (torch's part, reported apart) then plan offline as `python -m nnscaler.plan` does."""
    t0 = time.perf_counter()
    graph = capture(model, inputs, both_modes=False)
    trace_s = time.perf_counter() - t0
    result = plan_offline(graph, cluster, devices, pas_config={"use_bf16": True})
    return {
        "row": row,
        "nodes": len(graph.nodes),
        "trace_s": round(trace_s, 1),
        "search_s": round(result.seconds, 1),
        "total_s": round(trace_s + result.seconds, 1),
        "ilp": result.best.spmd.stats,
        "chosen": result.best.label() + f" plan_ngpus={result.setup.plan_ngpus}",
        "mesh": list(result.plan.mesh),
        "configurations": len(result.scored),
        "target_s": 60,
        "target_applies_to": "search_s",
    }


def plan_70b(layers: int | None) -> dict:
    model, inputs = _llama(layers, 8192, 64, 8192, 28672, 64, 8, 80)
    return _offline_row(
        "llama3-70b offline plan, 64x H100 (8 nodes)", model, inputs, load_cluster("h100x64_ib"), 64
    )


def plan_405b(layers: int | None) -> dict:
    model, inputs = llama3_405b_16k(layers)
    return _offline_row(
        "llama3-405b 16K offline plan, 2048x H100 (256 nodes), pipelines and meshes searched",
        model,
        inputs,
        cluster_spec("h100x2048_ib"),
        2048,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="8b-compile,70b-plan")
    ap.add_argument("--layers", type=int, default=None)
    args = ap.parse_args()
    rows = {"8b-compile": compile_8b, "70b-plan": plan_70b, "405b-plan": plan_405b}
    for name in args.rows.split(","):
        print(json.dumps(rows[name](args.layers), default=str), flush=True)


if __name__ == "__main__":
    main()
