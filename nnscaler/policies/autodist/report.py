"""plan_report.md: what autodist chose, per module (partition, devices, predicted time, memory,
communication), the totals, and the same figures for the standard recipes under the same model."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path

from nnscaler.atomic_files import write_atomic
from nnscaler.config import ComputeConfig
from nnscaler.graph.ir import Graph
from nnscaler.policies.autodist.candidate import Candidate
from nnscaler.policies.autodist.context import PlannerSetup
from nnscaler.policies.autodist.cp_search import evaluate_any_plan
from nnscaler.policies.autodist.model_error import speedup_words
from nnscaler.policies.autodist.policy import planner_setup
from nnscaler.policies.autodist.recipes import standard_recipes
from nnscaler.policies.autodist.report_cp import cp_report_lines
from nnscaler.policies.autodist.report_ep import ep_report_lines
from nnscaler.policies.autodist.report_reasons import why_not_taken
from nnscaler.policies.autodist.report_schedule import schedule_report_lines
from nnscaler.policies.autodist.report_words import module_group, module_words, short_op
from nnscaler.policies.plan import Plan
from nnscaler.policies.stage_balance import stage_report_lines

__all__ = ["plan_report", "plan_report_text", "write_plan_report", "REPORT_NAME"]

REPORT_NAME = "plan_report.md"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.3f}"


def plan_report(
    graph: Graph,
    plan: Plan,
    setup: PlannerSetup,
    scored: list[Candidate] | None = None,
    recipes: bool = True,
    whole: Sequence[str] = (),
) -> str:
    """The report as Markdown (see the module docstring). `whole`: the lines of its 'What stays whole'
    section (the compile writes them from the partitioned program: nnscaler.parallel.replicated)."""
    cand = evaluate_any_plan(graph, setup, plan)
    res = cand.spmd
    c = setup.cluster
    dev = c.device
    lines = [
        "# Plan report (autodist)",
        "",
        f"Cluster: {c.name or 'unnamed'}: {c.nodes} node(s) x {c.devices_per_node} {dev.name} "
        f"({dev.bf16_tflops:g} bf16 / {dev.fp32_tflops:g} fp32 TFLOP/s, {dev.mem_bw_gbs:g} GB/s, "
        f"{dev.memory_gb:g} GB); links: intra-node {c.intra_node.bandwidth_gbs:g} GB/s "
        f"{c.intra_node.latency_us:g} us, inter-node {c.inter_node.bandwidth_gbs:g} GB/s {c.inter_node.latency_us:g} us.",
        "",
        f"Chosen: {cand.label()} over plan_ngpus={setup.plan_ngpus}, x{setup.dp_size} data-parallel "
        f"replica(s), ZeRO stage {setup.memory.zero_stage}"
        + (f", recompute {', '.join(plan.recompute) or 'ROOT'}" if plan.recompute else "")
        + (
            f"; 2-D splits over a {' x '.join(map(str, plan.mesh))} mesh of each stage's devices "
            "(partition `(axis 0, axis 1)`)"
            if plan.mesh
            else ""
        )
        + ".",
        "",
        f"Predicted step: {_ms(cand.step_time)} ms ({_ms(cand.time_per_micro)} ms per micro-batch); memory on "
        f"the fullest device: {_gb(cand.memory)} GB (limit {_gb(setup.mem_limit)} GB).",
    ]
    lines += cp_report_lines(graph, plan, setup, cand)
    lines += ep_report_lines(graph, plan, setup, cand)
    lines += stage_report_lines(graph, plan)
    lines += schedule_report_lines(plan, cand, scored)
    lines += list(whole)
    if res is not None and res.stats:
        s = res.stats
        lines += [
            "",
            f"Re-costed with {s['nodes']} nodes ({s['binaries']} binaries, {s['continuous']} continuous, "
            f"{s['constraints']} constraints; {s['solver']}).",
        ]
    if scored:
        lines += [
            "",
            "## Configurations searched",
            "",
            "| configuration | step (ms) | per micro-batch (ms) | memory (GB) |",
            "|---|---|---|---|",
        ]
        for x in sorted(scored, key=lambda x: x.time_per_micro):
            lines.append(f"| {x.label()} | {_ms(x.step_time)} | {_ms(x.time_per_micro)} | {_gb(x.memory)} |")
    if res is not None:
        lines += _modules(graph, plan, setup, res)
    if res is not None:
        lines += module_words(graph, plan, setup)
    if recipes:
        lines += _recipes(graph, setup, cand, scored)
    return "\n".join(lines) + "\n"


def _recipes(graph: Graph, setup: PlannerSetup, cand: Candidate, scored: list[Candidate] | None) -> list[str]:
    """The standard recipes' table; each one faster than the chosen plan says why it was not taken."""
    lines = [
        "",
        "## Standard recipes (same cost model)",
        "",
        "| recipe | step (ms) | memory (GB) | fits | why not taken |",
        "|---|---|---|---|---|",
        f"| **autodist: {cand.label()}** | {_ms(cand.step_time)} | {_gb(cand.memory)} | "
        f"{'yes' if cand.memory <= setup.mem_limit else 'no'} | |",
    ]
    recipes = standard_recipes(graph, setup, setup.plan_ngpus * setup.dp_size, cand.nmicros)
    for r in recipes:
        why = "; ".join(why_not_taken(r, setup, scored)) if r.candidate.step_time < cand.step_time else ""
        lines.append(
            f"| {r.name} | {_ms(r.candidate.step_time)} | {_gb(r.candidate.memory)} | "
            f"{'yes' if r.fits else 'no'} | {why} |"
        )
    if setup.global_batch:
        note = "split over its data-parallel replicas and its best micro-batch count."
    else:
        note = "(its micro-batches grow or shrink with its data-parallel degree) and the same micro-batches."
    lines += ["", f"Every recipe takes the same global batch per step as the chosen plan, {note}"]
    fitting = [r for r in recipes if r.fits]
    if fitting:
        best = min(fitting, key=lambda r: r.candidate.step_time)
        words = speedup_words(
            cand.step_time, best.candidate.step_time, f"the best recipe that fits ({best.name})"
        )
        lines += ["", words] if words else []
    return lines


def _modules(graph: Graph, plan: Plan, setup: PlannerSetup, res) -> list[str]:
    group = module_group(graph, setup.pivots)
    order: list[str] = []
    splits: dict[str, Counter] = defaultdict(Counter)
    time: dict[str, float] = defaultdict(float)
    comm: dict[str, float] = defaultdict(float)
    mem: dict[str, float] = defaultdict(float)
    stage_of: dict[str, int] = {}
    starts = set(plan.pipeline.starts) if plan.pipeline else set()
    stage = -1 if starts else 0
    for n in graph.nodes:
        if n.name in starts:
            stage += 1
        g = group[n.name]
        if g not in time:
            order.append(g)
            stage_of[g] = max(stage, 0)
        p = plan.node(n.name)
        if p.mesh_splits:
            splits[g][f"{short_op(n.op)}:{p.describe()}"] += 1
        elif p.is_split:
            splits[g][f"{short_op(n.op)}:{p.split}" + (f"/{p.blocks}" if p.blocks > 1 else "")] += 1
        time[g] += res.node_time[n.name]
        comm[g] += res.node_comm[n.name]
        mem[g] += res.node_memory[n.name]
    tp = plan.tp_size
    lines = [
        "",
        "## Per module",
        "",
        "| module | partition | devices | time (ms) | comm (ms) | memory (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for g in order:
        part = ", ".join(f"{k} x{v}" for k, v in sorted(splits[g].items())) or "replicated"
        s = stage_of[g] % (plan.pipeline.pp_size if plan.pipeline else 1)
        devs = f"{s * tp}-{s * tp + tp - 1}" if tp > 1 else f"{s}"
        devs = (f"stage {stage_of[g]}: " if plan.pipeline else "") + devs
        lines.append(f"| {g} | {part} | {devs} | {_ms(time[g])} | {_ms(comm[g])} | {mem[g] / 1e6:.2f} |")
    lines.append(
        f"| **total** | {sum(1 for p in plan.nodes.values() if p.is_split)} split / {len(graph.nodes)} ops | "
        f"{setup.plan_ngpus} | {_ms(sum(time.values()))} | {_ms(sum(comm.values()))} | {sum(mem.values()) / 1e6:.2f} |"
    )
    lines += [
        "",
        "Times are per micro-batch (forward + backward) on one device, summed over stages; memory is "
        "per device of the module's stage (weights, gradients, optimizer state, saved activations).",
    ]
    return lines


def plan_report_text(graph: Graph, plan: Plan, cfg: ComputeConfig, whole: Sequence[str] = ()) -> str:
    """The report of an autodist plan compiled with `cfg` (re-costed for the traced shapes); `whole`: see
    plan_report."""
    return plan_report(graph, plan, planner_setup(graph, cfg), whole=whole)


def write_plan_report(graph: Graph, plan: Plan, cfg: ComputeConfig, outdir: str | Path) -> Path:
    """Write plan_report.md for an autodist plan into `outdir` (beside the generated code)."""
    path = Path(outdir) / REPORT_NAME
    write_atomic(path, plan_report_text(graph, plan, cfg))
    return path
