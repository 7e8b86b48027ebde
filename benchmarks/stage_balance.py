"""How even the pipeline stages of the `pp` policy are, on models whose layers cost different amounts.

For each model (the unequal stack of tests/zoo_unequal.py: embedding, state-space, attention and
mixture-of-experts layers, a head; the graph network of the same file: index arithmetic, message
passing with index_select / index_add, and `gnn_flat`, the same without a ModuleList; a Llama from
tests/zoo.py) and each pipeline degree, the model
is traced (no processes, no devices) and planned with `make_plan(graph, 'pp', ComputeConfig(pp, pp,
use_end2end=True))`, and printed as JSON: each stage's forward FLOPs and weight bytes (as the balancer,
nnscaler/policies/stage_balance.py, counts them: op_cost.graph_costs), their shares, the heaviest /
lightest stage ratio (the issue's target: at most 1.3 on the unequal stack), which candidates the
starts were chosen from (blocks, modules inside the blocks, operators) and where each stage starts.
For comparison, `blocks_only` is the same balancer restricted to block boundaries (the layers).

    python benchmarks/stage_balance.py [--pp 2 4] [--models unequal gnn gnn_flat llama]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nnscaler import ComputeConfig  # noqa: E402
from nnscaler.graph.capture import capture  # noqa: E402
from nnscaler.policies import make_plan  # noqa: E402
from nnscaler.policies.stage_balance import balanced_starts, stage_shares  # noqa: E402
from nnscaler.policies.staging import candidate_levels  # noqa: E402
from tests import zoo  # noqa: E402

MODELS = {
    "unequal": "tests.zoo_unequal:build_unequal",
    "gnn": "tests.zoo_unequal:build_gnn",
    "gnn_flat": "tests.zoo_unequal:build_gnn_flat",
    "llama": "llama_deep",
}
"""Benchmark name -> zoo model (llama_deep: tests/zoo.py's tiny Llama with 8 decoder layers)."""


def _ratio(values: list[float]) -> float:
    return round(max(values) / min(values), 3) if min(values) > 0 else float("inf")


def _blocks_only(graph, pp: int) -> dict:
    """The balancer on block boundaries alone (what layer-boundary pivots can give)."""
    blocks = candidate_levels(graph)[0][1]
    if pp > len(blocks):
        return {"error": f"{len(blocks)} blocks for {pp} stages"}
    flops = [s.flops for s in stage_shares(graph, balanced_starts(graph, blocks, pp))]
    return {"stage_flops": flops, "heaviest_over_lightest": _ratio(flops)}


def measure(name: str, pp: int, graph) -> dict:
    cfg = ComputeConfig(pp, pp, use_end2end=True, pas_config={"pipeline_nmicros": 2 * pp})
    t0 = time.perf_counter()
    plan = make_plan(graph, "pp", cfg)
    seconds = time.perf_counter() - t0
    index = {n.name: i for i, n in enumerate(graph.nodes)}
    starts = [index[s] for s in plan.pipeline.starts]
    shares = stage_shares(graph, starts)
    flops = [s.flops for s in shares]
    return {
        "model": name,
        "pp": pp,
        "stages": [
            {
                "starts_at": f"{graph.nodes[i].module_path or '(model forward)'}: {graph.nodes[i].op}",
                "flops": s.flops,
                "flops_share": round(s.flops_share, 4),
                "param_bytes": s.params,
                "params_share": round(s.params_share, 4),
            }
            for i, s in zip(starts, shares)
        ],
        "heaviest_over_lightest": _ratio(flops),
        "params_heaviest_over_lightest": _ratio([s.params for s in shares]),
        "plan_note": plan.notes[0] if plan.notes else "",
        "plan_seconds": round(seconds, 3),
        "blocks_only": _blocks_only(graph, pp),
    }


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args(argv)
    logging.getLogger("nnscaler").setLevel(logging.WARNING)
    out = []
    for name in args.models:
        model, make_batch = zoo.build(MODELS[name])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            graph = capture(model, make_batch(1, 2))
        for pp in args.pp:
            out.append(measure(name, pp, graph))
    print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
