"""How well autodist's cost model, fed with measurements of this machine, predicts real step times.

For each tiny zoo model and each of three plans on two CPU processes over gloo — data parallel
(`dp`, ComputeConfig(1, 2)), Megatron-style tensor parallel (`tp`, (2, 2)) and the plan autodist
searches with the measured costs (`autodist`, (2, 2)) — it prints the predicted time of one
training step (forward + backward + gradient synchronisation; the optimizer update is not part of
the cost model and is not timed) beside the measured median, and their ratio. Target: every ratio
within 25% (0.75 .. 1.25).

The measured database comes first: `profile_graph` times every op of each model at the local shapes
of its candidate splits (one thread, as each of the two processes gets one core); it is kept
(`--db`) and reused unless `--reprofile`. Then the two processes fit the gloo link from timed
all-reduces (`profile_link`), right before the steps they time: on a shared machine gloo's latency
moves with the load, so the link is measured beside what it is to predict. Link fit and steps are
repeated `--rounds` times (each round's steps predicted with that round's link); a row's ratio is the
median over rounds, and every round's ratio is printed too, so the machine's own noise shows.

    python benchmarks/cost_model_fit.py [--models gpt,llama,bert,mlp] [--steps 30] [--db ops_cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import load_note  # noqa: E402
from nnscaler import ComputeConfig  # noqa: E402
from nnscaler.graph.ir import graph_from_json  # noqa: E402
from nnscaler.parallel.compile import compile_module  # noqa: E402
from nnscaler.policies import Plan  # noqa: E402
from nnscaler.policies.autodist import planner_setup  # noqa: E402
from nnscaler.policies.autodist.evaluate import evaluate_plan  # noqa: E402
from nnscaler.policies.autodist.profiler import ProfileDB, profile_graph, profile_link  # noqa: E402
from tests import zoo  # noqa: E402

PLANS = [("dp", 1), ("tp", 2), ("autodist", 2)]
"""(policy, plan_ngpus) on 2 processes."""
WORLD = 2
DUMMY_SEED = 12345


def _config(policy: str, plan_ngpus: int, db: str) -> ComputeConfig:
    pas = {"cluster": "cpu_gloo", "profile_db_path": db} if policy == "autodist" else {}
    return ComputeConfig(plan_ngpus, WORLD, pas_config=pas)


def _compiled(name: str, policy: str, plan_ngpus: int, db: str, outdir: Path, batch: int):
    model, make_batch = zoo.build(name, seed=0)
    dummy = make_batch(DUMMY_SEED, batch)
    result = compile_module(model, dummy, policy, _config(policy, plan_ngpus, db), outdir, name)
    plan = Plan.from_json((outdir / "plan.json").read_text())
    return result.graph, plan


def build_db(models: list[str], path: Path, batch: int) -> ProfileDB:
    """Time every op of every model (1 and 2 ways); the link is measured beside the steps."""
    torch.set_num_threads(1)
    db = ProfileDB("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        for name in models:
            model, make_batch = zoo.build(name, seed=0)
            result = compile_module(
                model, make_batch(DUMMY_SEED, batch), "dp", ComputeConfig(1, 1), Path(tmp) / name, name
            )
            profile_graph(result.graph, ways=(1, 2), repeats=9, db=db)
    db.save(path)
    return db


def predict(
    name: str, policy: str, plan_ngpus: int, db: str, outdir: Path, batch: int, cost_db: str | None = None
) -> dict:
    """The plan compiled with database `db`, costed with `cost_db` (default: the same)."""
    if (outdir / "plan.json").exists():
        graph = graph_from_json((outdir / "graph.json").read_text())
        plan = Plan.from_json((outdir / "plan.json").read_text())
    else:
        graph, plan = _compiled(name, policy, plan_ngpus, db, outdir, batch)
    pas = {"cluster": "cpu_gloo", "profile_db_path": cost_db or db}
    setup = planner_setup(graph, ComputeConfig(plan_ngpus, WORLD, pas_config=pas))
    cand = evaluate_plan(graph, setup, plan)
    return {"predicted_s": cand.step_time, "split": plan.split_summary()["split"], "ops": len(graph.nodes)}


def _step_worker(rank: int, tmp: str, cases: list, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/step_store", rank=rank, world_size=WORLD)
    import nnscaler

    nnscaler.init()  # the group is up; this arranges the orderly teardown at exit
    modules = {}
    for rnd in range(args.rounds):
        # the link as this round finds it: gloo's latency on a shared machine moves with its load, so
        # it is measured beside the steps it is to predict
        link = profile_link()
        shared_db = Path(tmp, f"ops_and_link_{rnd}.json")
        if rank == 0:
            db = ProfileDB.load(args.db)
            db.links["intra_node"] = {"bandwidth_gbs": link.bandwidth_gbs, "latency_us": link.latency_us}
            db.save(shared_db)
        dist.barrier()
        out = {}
        for name, policy, plan_ngpus in cases:
            key = f"{name}/{policy}"
            if key not in modules:  # compiled once, in the first round (autodist plans with its link)
                model, make_batch = zoo.build(name, seed=0)
                pm = nnscaler.parallelize(
                    model,
                    make_batch(DUMMY_SEED, args.batch),
                    policy,
                    _config(policy, plan_ngpus, str(shared_db)),
                    gen_savedir=os.path.join(tmp, "gen", f"{name}_{policy}"),
                )
                modules[key] = (pm, make_batch)
            pm, make_batch = modules[key]
            data = make_batch(1000 + rank // plan_ngpus, args.batch)
            times = []
            for step in range(args.warmup + args.steps):
                dist.barrier()
                t0 = time.perf_counter()
                loss = zoo.extract_loss(pm(**data))
                loss.backward()
                pm.sync_grad()  # no-op where backward already settled the gradients
                if step >= args.warmup:
                    times.append(time.perf_counter() - t0)
                pm.zero_grad(set_to_none=False)
            gathered = [None] * WORLD
            dist.all_gather_object(gathered, statistics.median(times))
            out[key] = max(gathered)  # a step ends when its slowest rank is done
        if rank == 0:
            Path(tmp, f"measured_{rnd}.json").write_text(json.dumps(out))
    modules.clear()
    nnscaler.uninit()  # gradient buckets first, then the group


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="gpt,llama,bert,mlp")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument(
        "--rounds", type=int, default=3, help="link fit + steps, repeated; each row's ratio is the median"
    )
    ap.add_argument("--db", default=None, help="measured database (default: a file in the temp dir)")
    ap.add_argument("--reprofile", action="store_true", help="measure again even if --db exists")
    args = ap.parse_args()
    models = args.models.split(",")
    db_path = Path(args.db or Path(tempfile.gettempdir()) / "nnscaler_ops_cpu.json")
    args.db = str(db_path)
    t0 = time.perf_counter()
    if args.reprofile or not db_path.exists():
        db = build_db(models, db_path, args.batch)
    else:
        db = ProfileDB.load(db_path)
    profile_s = time.perf_counter() - t0
    rows = []
    links = []
    with tempfile.TemporaryDirectory() as tmp:
        cases = [(m, p, n) for m in models for p, n in PLANS]
        mp.spawn(_step_worker, args=(tmp, cases, args), nprocs=WORLD, join=True)
        per_round = []  # (link, {case: (predicted, measured)}) per round
        for rnd in range(args.rounds):
            measured = json.loads(Path(tmp, f"measured_{rnd}.json").read_text())
            db_path = str(Path(tmp, f"ops_and_link_{rnd}.json"))
            db = ProfileDB.load(db_path)
            links.append(db.links.get("intra_node"))
            pairs = {}
            for name, policy, n in cases:
                # the plan the run compiled (round 0's link) re-costed with this round's link
                outdir = Path(tmp) / "plans" / f"{name}_{policy}"
                pred = predict(
                    name, policy, n, str(Path(tmp, "ops_and_link_0.json")), outdir, args.batch, db_path
                )
                pairs[(name, policy, n)] = (pred, measured[f"{name}/{policy}"])
            per_round.append(pairs)
        for case in cases:
            name, policy, n = case
            preds = [r[case][0]["predicted_s"] for r in per_round]
            reals = [r[case][1] for r in per_round]
            ratios_case = sorted(p / m for p, m in zip(preds, reals))
            rows.append(
                {
                    "model": name,
                    "plan": f"{policy} ComputeConfig({n}, {WORLD})",
                    "split_ops": per_round[0][case][0]["split"],
                    "predicted_ms": round(statistics.median(preds) * 1e3, 3),
                    "measured_ms": round(statistics.median(reals) * 1e3, 3),
                    "ratio": round(statistics.median(ratios_case), 3),
                    "ratio_per_round": [round(r, 3) for r in (p / m for p, m in zip(preds, reals))],
                }
            )
    ratios = [r["ratio"] for r in rows]
    print(
        json.dumps(
            {
                "benchmark": "cost model (measured database) vs measured step time, 2 gloo processes",
                "links_per_round": links,
                "rounds": args.rounds,
                "ops_measured": len(db.entries),
                "profile_s": round(profile_s, 1),
                "rows": rows,
                "within_25pct": sum(0.75 <= r <= 1.25 for r in ratios),
                "of": len(ratios),
                "worst_ratio": max(ratios, key=lambda r: abs(r - 1.0)),
                "target": "every ratio in 0.75 .. 1.25",
                "machine": load_note(),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
