"""What stays whole, per family of the tests' zoo and policy (issue 40): the share of parameters and of
forward FLOPs each rank holds / computes whole (replicated over its stage's devices), the most one rank
holds in all, and the top causes as the compile names them (nnscaler.parallel.replicated).

One process, compile only (no process group, no training): every model is traced once, then compiled
under each policy with ComputeConfig(2, 2) (`pp`: end-to-end mode, 2 micro-batches) into a temporary
directory. Prints one JSON object per (family, policy), then a summary: the families above 60% under
tp 2 (whole parameters or whole FLOPs) and, of those, the ones whose causes are not named (the named
causes cover less than half of what stays whole): `flagged`; and the families where one rank holds more
than 60% of the parameters in all under tp 2 (whole ones plus its pieces of split ones).

    python benchmarks/replicated_share.py [--families gpt,t5] [--policies tp,autodist,pp] [--top 3]

Families: tests/zoo.py's builders (the parity models and the others; 'meta', Llama-3-8B on the meta
device, and the deeper pipeline copies only when named), tests/zoo_families.py FAMILIES,
tests/zoo_finetune.py FINETUNE_MODELS and tests/zoo_vl.py's Qwen2-VL.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from nnscaler import ComputeConfig  # noqa: E402
from nnscaler.parallel import compile_module  # noqa: E402

THRESHOLD = 0.6
ONLY_WHEN_NAMED = {"meta", "gpt_deep", "llama_deep"}
"""Zoo builders left out unless --families names them: an 8B model on the meta device, deeper copies."""


def families() -> dict[str, str]:
    """Family name -> builder name for tests.zoo.build."""
    from tests import zoo, zoo_families, zoo_finetune

    out = {name: name for name in zoo.MODELS}
    out.update(zoo_families.FAMILIES)
    out.update(zoo_finetune.FINETUNE_MODELS)
    out["qwen2_vl"] = "tests.zoo_vl:build_qwen2_vl"
    return out


def _config(policy: str) -> ComputeConfig:
    if policy in ("pp", "hybrid"):
        return ComputeConfig(2, 2, use_end2end=True, pas_config={"pipeline_nmicros": 2})
    return ComputeConfig(2, 2)


def _named_enough(share) -> bool:
    """Do the named causes cover at least half of the whole parameters and of the whole FLOPs?"""
    named_p = sum(r.param_share for r in share.reasons if r.named)
    named_f = sum(r.flops_share for r in share.reasons if r.named)
    return named_p >= share.param_share / 2 and named_f >= share.flops_share / 2


def run_family(name: str, builder: str, policies: list[str], top: int, batch: int) -> list[dict]:
    """Compile `name` under each policy (one trace, reused); one row per policy."""
    from tests import zoo

    torch.manual_seed(0)
    model, make_batch = zoo.build(builder, seed=0)
    data = make_batch(0, batch)
    graph, rows = None, []
    for policy in policies:
        row: dict = {"family": name, "policy": policy}
        t0 = time.perf_counter()
        try:
            with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
                warnings.simplefilter("ignore")
                res = compile_module(model, data, policy, _config(policy), Path(tmp), "bench", graph=graph)
            graph = res.graph
            share = res.replicated
            row.update(
                param_share=round(share.param_share, 4),
                flops_share=round(share.flops_share, 4),
                local_param_share=round(share.local_share, 4),
                stages=[[round(s.held_share, 4), round(s.param_share, 4)] for s in share.stages],
                named=_named_enough(share),
                top_reasons=[
                    {
                        "kind": r.kind,
                        "param_share": round(r.param_share, 4),
                        "flops_share": round(r.flops_share, 4),
                        "why": r.text,
                        "e.g.": r.example,
                    }
                    for r in share.top(top)
                ],
            )
        except Exception as exc:  # a family a policy refuses: say so and go on
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
        row["seconds"] = round(time.perf_counter() - t0, 2)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--families", default="", help="comma-separated family names (default: all)")
    parser.add_argument("--policies", default="tp,autodist,pp", help="comma-separated policies")
    parser.add_argument("--top", type=int, default=3, help="causes printed per row")
    parser.add_argument("--batch", type=int, default=4, help="batch size of the traced inputs")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    known = families()
    names = [f for f in args.families.split(",") if f] or [f for f in known if f not in ONLY_WHEN_NAMED]
    unknown = [f for f in names if f not in known]
    if unknown:
        parser.exit(2, f"replicated_share.py: unknown families {unknown}; known: {sorted(known)}\n")
    policies = [p for p in args.policies.split(",") if p]
    t0 = time.perf_counter()
    above, flagged, errors, local_above = [], [], [], []
    for name in names:
        try:
            rows = run_family(name, known[name], policies, args.top, args.batch)
        except Exception as exc:  # the model itself failed to build or run
            rows = [{"family": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}]
        for row in rows:
            print(json.dumps(row), flush=True)
            if "error" in row:
                errors.append(f"{name}/{row.get('policy', '-')}")
            elif row["policy"] == "tp":
                if max(row["param_share"], row["flops_share"]) > THRESHOLD:
                    above.append(name)
                    if not row["named"]:
                        flagged.append(name)
                if row["local_param_share"] > THRESHOLD:
                    local_above.append(name)
    summary = {
        "summary": True,
        "families": len(names),
        "policies": policies,
        "above_60_under_tp2": above,
        "flagged": flagged,
        "rank_holds_above_60_under_tp2": local_above,
        "errors": errors,
        "seconds": round(time.perf_counter() - t0, 1),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
