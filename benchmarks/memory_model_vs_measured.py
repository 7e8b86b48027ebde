"""autodist's memory model beside measured memory (issue 42: predicted / measured peak in 0.85-1.15).

For every zoo family (an LM, an encoder, a vision model, a mixture of experts) under dp, tp, pp, ZeRO 1
and 3 and recompute, two gloo processes `nnscaler.parallelize` the model and train two steps; the
second is measured on each rank. Beside it, autodist costs the same plan (the policy's Plan, from the
same graph, through evaluate_plan) and prints its parts: weights, gradients, optimizer state,
activations kept for backward, and transient buffers (communication, the backward's gradients).

How memory is measured (CPU has no torch.cuda.max_memory_allocated): the bytes live when the step
starts are every tensor the garbage collector can reach (storages counted once: parameters,
gradients and reducer buckets, optimizer state; the batch and what was live before the row's model
was built left out), and the step's own high-water
mark above them comes from torch's profiler memory events (profile_memory=True: every allocation and
free of the CPU allocator, summed in time order). The profiler sees the allocator itself, so kernels'
workspaces, autograd's saved tensors and collectives' buffers all count, and nothing is estimated.

    python benchmarks/memory_model_vs_measured.py [--families gpt,llama] [--policies dp,tp] [--published]

Prints one JSON object per (family, policy) and, with --published, per published layout (predicted
GB per GPU beside the 80 GB the run fitted in).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from dataclasses import replace
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

import torch

FAMILIES: dict[str, tuple[str, int, str]] = {
    "gpt": ("gpt", 16, "Block"),
    "llama": ("llama", 16, "LlamaDecoderLayer"),
    "bert": ("bert", 16, "BertLayer"),
    "vit": ("vit", 16, "ViTLayer"),
    "mixtral": ("mixtral", 16, "MixtralDecoderLayer"),
}
"""Family -> (zoo model, batch per replica, the layer class recomputed under 'recompute')."""

POLICIES: dict[str, dict[str, Any]] = {
    "dp": {"policy": "dp", "plan_ngpus": 1},
    "tp": {"policy": "tp", "plan_ngpus": 2},
    "pp": {"policy": "pp", "plan_ngpus": 2, "nmicros": 2, "config": {"use_end2end": True}},
    "zero1": {"policy": "dp", "plan_ngpus": 1, "config": {"use_zero": True, "zero_stage": 1}},
    "zero3": {"policy": "dp", "plan_ngpus": 1, "config": {"use_zero": True, "zero_stage": 3}},
    "recompute": {"policy": "dp", "plan_ngpus": 1, "recompute": True},
}
"""Policy row -> how it is run (two processes; plan_ngpus 1 is two data-parallel replicas)."""

WORLD = 2


def _config(family: str, row: str):
    from nnscaler import ComputeConfig

    spec = POLICIES[row]
    pas: dict[str, Any] = {}
    if spec.get("recompute"):
        pas["recompute_modules"] = FAMILIES[family][2]
    if spec.get("nmicros"):
        pas["pipeline_nmicros"] = spec["nmicros"]
        pas["pipeline_nstages"] = spec["plan_ngpus"]
    return ComputeConfig(spec["plan_ngpus"], WORLD, pas_config=pas, **spec.get("config", {}))


def live_tensors() -> dict[int, tuple[int, torch.Tensor]]:
    """Storage address -> (bytes, a tensor holding it) for every CPU tensor the garbage collector reaches."""
    seen: dict[int, tuple[int, torch.Tensor]] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_sparse:
            try:  # tracing's fake tensors may linger: they hold no memory
                st = obj.untyped_storage()
                ptr = st.data_ptr()
            except (RuntimeError, NotImplementedError):
                continue
            if st.nbytes():
                seen[ptr] = (st.nbytes(), obj)
    return seen


def live_bytes(exclude: tuple[torch.Tensor, ...] = (), old: dict | None = None) -> int:
    """Bytes of every tensor storage the garbage collector reaches (each storage once), but `exclude`'s
    and those in `old` (a live_tensors() result, whose tensors the caller keeps alive, so that no new
    storage can take one of their addresses)."""
    skip = {t.untyped_storage().data_ptr() for t in exclude} | set(old or ())
    return sum(b for ptr, (b, _) in live_tensors().items() if ptr not in skip)


def step_peak(step) -> int:
    """The high-water mark of CPU allocator bytes above the start while `step()` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    run = peak = 0
    for e in sorted(events, key=lambda e: e.start_ns()):
        run += e.nbytes()
        peak = max(peak, run)
    return peak


def measure_rank(rank: int, world: int, family: str, rows: list[str], root: str) -> list[dict]:
    """One rank: each row's parallelized model, a warm-up step, then the measured step."""
    import nnscaler

    nnscaler.init()
    out = []
    for row in rows:
        gc.collect()
        before = live_tensors()  # what earlier rows left behind (generated modules' caches) is not this row's
        start, peak = _measure_row(family, row, f"{root}/{row}", before)
        del before
        out.append({"row": row, "rank": rank, "start": start, "peak": start + peak})
        gc.collect()
    return out


def _measure_row(family: str, row: str, savedir: str, old: dict) -> tuple[int, int]:
    """(live bytes when the measured step starts, its high-water mark above them)."""
    from nnscaler import build_optimizer, parallelize
    from tests import zoo

    model, make_batch = zoo.build(FAMILIES[family][0], seed=0)
    batch = make_batch(1, FAMILIES[family][1])
    pm = parallelize(model, batch, POLICIES[row]["policy"], _config(family, row), gen_savedir=savedir)
    del model
    opt = build_optimizer(pm, torch.optim.AdamW, lr=1e-3)
    nmicros = POLICIES[row].get("nmicros")

    def step() -> None:
        if nmicros:
            pm.train_step([batch] * nmicros)
        else:
            zoo.extract_loss(pm(**batch)).backward()
        opt.step()
        opt.zero_grad()

    step()  # optimizer state and buckets exist from here on
    gc.collect()
    start = live_bytes(tuple(v for v in batch.values() if isinstance(v, torch.Tensor)), old)
    return start, step_peak(step)


def predict(family: str, row: str) -> dict[str, float]:
    """autodist's predicted peak bytes per device for the policy's plan of `family`, with its parts."""
    from nnscaler.graph.capture import capture
    from nnscaler.policies.autodist import load_cluster, planner_setup
    from nnscaler.policies.autodist.context import stage_context, transient_bytes
    from nnscaler.policies.autodist.evaluate import evaluate_plan
    from nnscaler.policies.recompute import recompute_paths
    from nnscaler.policies.registry import resolve_policy
    from tests import zoo

    model, make_batch = zoo.build(FAMILIES[family][0], seed=0)
    batch = make_batch(1, FAMILIES[family][1])
    graph = capture(model, batch, both_modes=False)
    cfg = _config(family, row)
    _, policy = resolve_policy(POLICIES[row]["policy"])
    plan = policy(graph, cfg)
    if POLICIES[row].get("recompute") and not plan.recompute:  # parallelize applies recompute_modules itself
        plan = replace(plan, recompute=recompute_paths(graph, FAMILIES[family][2]))
    setup = planner_setup(graph, cfg, cluster=load_cluster("cpu_gloo"))
    cand = evaluate_plan(graph, setup, plan)
    ctx = stage_context(setup, plan.tp_size)
    return _parts(graph, setup, ctx, cand, transient_bytes(graph, ctx, setup, plan.recompute))


def _parts(graph, setup, ctx, cand, transient: float) -> dict[str, float]:
    """The peak (the largest stage's) split into weights, gradients, optimizer, activations, transient."""
    res = cand.spmd
    names = [n.name for n in graph.nodes]
    bounds = (cand.starts or [0]) + [len(names)]
    best: dict[str, float] = {}
    for s in range(len(bounds) - 1):
        stage = [res.choice[n] for n in names[bounds[s] : bounds[s + 1]]]
        parts = setup.memory.param_state_parts(sum(c.param_bytes for c in stage), ctx)
        inflight = min(len(bounds) - 1 - s, cand.nmicros) if cand.pp > 1 else 1
        parts["activations"] = sum(c.activation_bytes for c in stage) * inflight
        persist = setup.memory.grads_outlive_backward(ctx, cand.nmicros, pipelined=cand.pp > 1)
        parts["transient"] = transient
        peak = setup.memory.backward_live_peak(
            [c.activation_bytes * inflight for c in stage],
            [setup.memory.param_state_parts(c.param_bytes, ctx)["gradients"] for c in stage],
        )
        parts["total"] = setup.memory.peak_state(parts, parts["activations"], persist, peak) + transient
        if parts["total"] > best.get("total", -1.0):
            best = parts
    return best


def run_family(family: str, rows: list[str]) -> list[dict]:
    from tests.dist_util import spawn

    with tempfile.TemporaryDirectory() as tmp:
        try:
            ranks = spawn(measure_rank, WORLD, tmp, family, rows, tmp, timeout=600)
        except Exception as exc:  # one family failing does not hide the others' rows
            return [{"family": family, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}]
    out = []
    for k, row in enumerate(rows):
        measured = max(r[k]["peak"] for r in ranks)
        try:
            pred = predict(family, row)
        except Exception as exc:  # a plan autodist cannot cost: say so in the row
            out.append({"family": family, "policy": row, "measured": measured, "error": str(exc)[:300]})
            continue
        out.append(
            {
                "family": family,
                "policy": row,
                "predicted": round(pred["total"]),
                "measured": measured,
                "ratio": round(pred["total"] / measured, 3),
                "parts": {k: round(v) for k, v in pred.items() if k != "total"},
                "measured_at_step_start": max(r[k]["start"] for r in ranks),
            }
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--published", action="store_true", help="also the published layouts (meta, full size)")
    ap.add_argument("--only-published", action="store_true")
    args = ap.parse_args()
    if not args.only_published:
        for family in args.families.split(","):
            for line in run_family(family, args.policies.split(",")):
                print(json.dumps(line), flush=True)
    if args.published or args.only_published:
        from benchmarks.memory_published import published_rows

        for line in published_rows():
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
