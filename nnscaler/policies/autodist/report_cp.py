"""plan_report.md's context-parallel section: the degree and kind chosen, where the cp ranks sit, the
predicted cp communication, every kind at the chosen degree re-costed, and why the search did not take
the other degrees and kinds (the plan's 'autodist: not taken:' notes, written by cp_search)."""

from __future__ import annotations

from dataclasses import replace

from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph
from nnscaler.policies.autodist.candidate import Candidate
from nnscaler.policies.autodist.context import PlannerSetup
from nnscaler.policies.autodist.cp_search import NOT_TAKEN, cost_with_cp, cp_options, reduced_setup, tp_part
from nnscaler.policies.autodist.evaluate import evaluate_plan
from nnscaler.policies.plan import Plan

__all__ = ["cp_report_lines", "NOT_TAKEN"]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f}"


def _kinds_table(graph: Graph, setup: PlannerSetup, plan: Plan, chosen: Candidate) -> list[str]:
    """Every kind at the plan's cp degree on the same tensor-parallel part, re-costed."""
    cp = plan.context_parallel
    sub = reduced_setup(setup, cp.size)
    base = evaluate_plan(graph, sub, tp_part(plan))
    open_setup = replace(setup, cp_kind=None, cp_ulysses_size=None)
    lines = [
        "",
        f"Every kind at cp={cp.size} on the same tensor-parallel part:",
        "",
        "| kind | step (ms) | cp comm (ms) | added to the step (ms) | why not taken |",
        "|---|---|---|---|---|",
    ]
    for option in cp_options(open_setup, cp.size):
        x = cost_with_cp(graph, sub, base, option)
        label = option.kind + (f" u{option.ulysses_size}" if option.kind == "hybrid" else "")
        if isinstance(x, str):
            lines.append(f"| {label} | - | - | - | cannot run: {x} |")
            continue
        same = (option.kind, option.ulysses_size) == (cp.kind, cp.ulysses_size)
        why = "" if same else _why(x, chosen)
        mark = f"**{label}**" if same else label
        lines.append(f"| {mark} | {_ms(x.step_time)} | {_ms(x.cp_comm)} | {_ms(x.cp_exposed)} | {why} |")
    return lines


def _why(x: Candidate, chosen: Candidate) -> str:
    gap = x.step_time - chosen.step_time
    if gap <= 0:
        return f"predicted {_ms(-gap)} ms faster here, but the search scored the chosen plan best"
    if x.cp.kind == "ring" and x.cp_exposed > chosen.cp_exposed:
        return (
            f"{_ms(gap)} ms slower: a plain ring on a causal mask leaves the last rank ~2x the average work"
        )
    if x.cp.kind == "ulysses":
        return f"{_ms(gap)} ms slower: its all-to-alls are not overlapped with compute"
    return f"{_ms(gap)} ms slower: more of its communication is not hidden behind attention"


def cp_report_lines(graph: Graph, plan: Plan, setup: PlannerSetup, cand: Candidate) -> list[str]:
    """The '## Context parallelism' section ([] for a plan the search did not weigh cp for)."""
    notes = [n.removeprefix(NOT_TAKEN) for n in plan.notes if n.startswith(NOT_TAKEN)]
    cp = plan.context_parallel
    if cp is None and not notes:
        return []
    lines = ["", "## Context parallelism", ""]
    if cp is None:
        lines.append("Chosen: none (cp=1): the sequence is not split.")
    else:
        tp = plan.tp_size // cp.size
        link = setup.cluster.link(cp.size, tp)
        where = "intra-node" if link == setup.cluster.intra_node else "inter-node"
        axis = "mesh axis 0 (cp ranks are tp apart)" if plan.mesh else "all of a stage's devices"
        lines.append(
            f"Chosen: cp={cp.size} ({cand.cp_label()}) over {axis}, {where}; tp={tp} on the rest. Predicted "
            f"cp communication: {_ms(cand.cp_comm)} ms per step per device; context parallelism adds "
            f"{_ms(cand.cp_exposed)} ms to the step (transfers not hidden behind attention, all-to-alls, a plain "
            "ring's causal imbalance; included in the step above)."
        )
        try:
            lines += _kinds_table(graph, setup, plan, cand)
        except PlanError as exc:
            lines += ["", f"(the other kinds could not be re-costed: {exc})"]
    if notes:
        lines += ["", "Other context-parallel degrees and kinds the search scored, and why not taken:", ""]
        lines += [f"- {n}" for n in notes]
    return lines
