"""plan_report.md's expert-parallel section: the ep degree chosen, the link its group spans, the
all-to-all bytes per MoE layer and per step, and why the search did not take the other degrees (the
plan's 'autodist: ep not taken:' notes, written by ep_search)."""

from __future__ import annotations

from nnscaler.graph.ir import Graph
from nnscaler.policies.autodist.candidate import Candidate
from nnscaler.policies.autodist.context import PlannerSetup, stage_context
from nnscaler.policies.autodist.ep_search import EP_NOT_TAKEN, ep_setup
from nnscaler.policies.autodist.expert_parallel import A2A_PER_MICRO, ep_link, moe_layers
from nnscaler.policies.plan import Plan

__all__ = ["ep_report_lines"]


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.3f}"


def _layers_table(graph: Graph, setup: PlannerSetup, cand: Candidate) -> list[str]:
    """One row per MoE layer: its experts, top-k, the all-to-all buffer and its bytes per step."""
    sub = ep_setup(setup, cand.ep)
    layers = moe_layers(graph, stage_context(sub, cand.tp, pipelined=cand.pp > 1))
    per_micro = A2A_PER_MICRO + (2 if cand.recompute else 0)
    lines = [
        "",
        "| experts op | experts (per rank) | top-k | all-to-all buffer (MB) | per step (MB) |",
        "|---|---|---|---|---|",
    ]
    for x in layers:
        step = x.a2a_bytes * per_micro * cand.nmicros
        lines.append(
            f"| {x.name} | {x.experts} ({x.experts // cand.ep}) | {x.top_k} | {_mb(x.a2a_bytes)} | {_mb(step)} |"
        )
    return lines


def ep_report_lines(graph: Graph, plan: Plan, setup: PlannerSetup, cand: Candidate) -> list[str]:
    """The '## Expert parallelism' section ([] for a plan the search did not weigh ep for)."""
    notes = [n.removeprefix(EP_NOT_TAKEN) for n in plan.notes if n.startswith(EP_NOT_TAKEN)]
    if cand.ep == 1 and not notes:
        return []
    lines = ["", "## Expert parallelism", ""]
    if cand.ep == 1:
        lines.append(
            "Chosen: none (ep=1): every rank keeps every expert"
            + (
                f" (their intermediate features split over tp={cand.tp} where they divide)."
                if cand.tp > 1
                else "."
            )
        )
    else:
        link = ep_link(setup.cluster, cand.ep, cand.tp)
        where = "intra-node" if link == setup.cluster.intra_node else "inter-node"
        axis = "mesh axis 0 (ep ranks are tp apart)" if cand.tp > 1 else "all of a stage's devices"
        per_micro = A2A_PER_MICRO + (2 if cand.recompute else 0)
        lines.append(
            f"Chosen: ep={cand.ep} over {axis}, {where} ({link.bandwidth_gbs:g} GB/s, {link.latency_us:g} us); "
            f"tp={cand.tp} on the rest. Tokens are split by batch on the ep axis and each all-to-all buffer is "
            f"tokens per rank x hidden x top-k x dtype bytes; {per_micro} all-to-alls per layer per micro-batch "
            "(dispatch and combine, forward and backward"
            + (", the forward twice under recompute" if cand.recompute else "")
            + f"). Predicted: {_mb(cand.ep_bytes)} MB per step per device, {cand.ep_comm * 1e3:.3f} ms "
            "(not overlapped; included in the step above). Expert weights, gradients and optimizer state "
            f"are 1/{cand.ep} per rank; expert gradients are reduced over the {setup.dp_size} data-parallel "
            f"replica(s) only, the other weights' over ep x dp = {cand.ep * setup.dp_size}."
        )
        lines += _layers_table(graph, setup, cand)
    if notes:
        lines += ["", "Other expert-parallel degrees the search scored, and why not taken:", ""]
        lines += [f"- {n}" for n in notes]
    return lines
