"""Balanced pipeline stages: which of the places a stage may start (staging.candidate_levels) become
stage starts, so that every stage costs about the same and holds weights.

One balancer for every pipeline planner: the `pp`/`hybrid` policies cost a node by its forward FLOPs
(op_cost.py, device-independent), autodist's pipeline search by its planned time on the device; both
give `choose_stages` the costs of the segments between candidate starts, and it runs the shared DP
(stage_dp.py) on the coarsest candidates first (the model's blocks), going to finer ones (modules
inside the blocks, then operators) only while the heaviest stage costs more than TARGET times the
lightest. A stage pays for the activations crossing its two ends (sent forward, their gradients sent
back), so a cut where a large activation crosses loses to one where little does.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph, Node, graph_fact
from nnscaler.policies.op_cost import graph_costs
from nnscaler.policies.stage_dp import stage_dp_py
from nnscaler.policies.staging import candidate_levels

__all__ = [
    "TARGET",
    "MAX_CANDIDATES",
    "COMM_FLOPS_PER_BYTE",
    "Segments",
    "StageChoice",
    "choose_stages",
    "balanced_stages",
    "balanced_starts",
    "node_cost",
    "flop_segments",
    "stage_shares",
    "stage_summary",
    "stage_report_lines",
]

TARGET = 1.3
"""Finer stage starts are tried while the heaviest stage costs more than this times the lightest."""

COMM_FLOPS_PER_BYTE = 2.0
"""What a byte crossing a stage boundary costs each of the two stages, in FLOPs (the activation
forward and its gradient backward): small next to a layer's matmuls, decisive between cuts that
cost the same otherwise."""

_CLOSE = 0.02
"""A finer level must beat a coarser one by more than this (relative) to be taken."""


@dataclass(frozen=True)
class Segments:
    """The runs of nodes between candidate starts: for each, its first node and what it costs."""

    starts: list[int]
    cost: list[float]
    act: list[float]
    """Bytes kept for backward per micro-batch (for the memory limit)."""
    param: list[float]
    """Bytes of weights (and their gradients and optimizer state, where the caller counts them)."""
    cross: list[float]
    """The cost of the boundary before each segment (cross[0] is unused)."""


@dataclass(frozen=True)
class StageChoice:
    """Where the stages start (node indices) and what each costs (its segments, boundaries left out)."""

    starts: list[int]
    costs: list[float]
    worst: float
    """The DP's objective: the costliest stage, boundaries included."""
    level: str
    """Which candidates the starts were chosen from ('blocks', 'modules 1 below the blocks', ...)."""

    @property
    def ratio(self) -> float:
        """Heaviest stage cost over the lightest (inf when a stage costs nothing)."""
        low = min(self.costs)
        return max(self.costs) / low if low > 0 else math.inf


MAX_CANDIDATES = 512
"""Finer levels with more places than this are skipped by the Python DP (about 1 s at 8 stages)."""

_EVENER = 1.25
"""... or by at most _CLOSE costlier with a heaviest/lightest ratio this many times smaller."""

DP = Callable[..., tuple[float, list[int]]]


def choose_stages(
    graph: Graph,
    nstages: int,
    segments_for: Callable[[list[int]], Segments],
    pivots: tuple[str, ...] = (),
    *,
    whole: tuple[str, ...] = (),
    nmicros: int = 1,
    mem_limit: float = math.inf,
    dp: DP = stage_dp_py,
    target: float = TARGET,
    max_candidates: int = MAX_CANDIDATES,
) -> StageChoice | None:
    """The balanced stages (see the module docstring); None when no split fits `mem_limit`. `whole`:
    module paths no stage start may fall inside (recomputed modules). Raises PlanError when there are
    fewer places to start a stage than stages. Levels finer than the first with enough places and
    with more than `max_candidates` places are not tried (the DP is quadratic in them)."""
    levels = candidate_levels(graph, pivots, whole)
    if nstages > len(levels[-1][1]):
        where = (
            f"instances of {', '.join(pivots)}"
            if pivots
            else "places between operators where only tensors cross"
        )
        raise PlanError(
            f"pipeline_nstages={nstages} but the model has only {len(levels[-1][1])} places a stage can start "
            f"(the graph's start and the {where}): use fewer stages"
            + (" or finer pipeline_pivots" if pivots else "")
        )
    best: StageChoice | None = None
    tried = False
    for level, cands in levels:
        if len(cands) < nstages or (tried and len(cands) > max_candidates):
            continue
        tried = True
        segs = segments_for(cands)
        need = [1 if p > 0 else 0 for p in segs.param]
        if sum(need) < nstages:  # too few segments hold weights for every stage to hold some
            need = None
        worst, first = dp(segs.cost, segs.act, segs.param, nstages, nmicros, mem_limit, segs.cross, need)
        if math.isinf(worst) and need is not None:
            worst, first = dp(segs.cost, segs.act, segs.param, nstages, nmicros, mem_limit, segs.cross, None)
        if math.isinf(worst):
            continue
        bounds = first + [len(cands)]
        costs = [sum(segs.cost[bounds[s] : bounds[s + 1]]) for s in range(nstages)]
        choice = StageChoice([cands[j] for j in first], costs, worst, level)
        if best is None or _better(choice, best):
            best = choice
        if best.ratio <= target:
            break
    return best


def _better(finer: StageChoice, coarser: StageChoice) -> bool:
    """Finer starts win when their costliest stage is clearly cheaper, or as cheap with clearly more
    even stages (a stage with a sliver of the work wastes its device)."""
    if finer.worst < coarser.worst * (1 - _CLOSE):
        return True
    return finer.worst <= coarser.worst * (1 + _CLOSE) and finer.ratio * _EVENER < coarser.ratio


def flop_segments(graph: Graph, cands: list[int]) -> Segments:
    """Segments costed by forward FLOPs, weight bytes and activation bytes (op_cost.graph_costs)."""
    costs = graph_costs(graph)
    bounds = list(cands) + [len(graph.nodes)]
    span = list(zip(bounds, bounds[1:]))
    return Segments(
        list(cands),
        [sum(costs.flops[a:b]) for a, b in span],
        [sum(costs.act_bytes[a:b]) for a, b in span],
        [sum(costs.param_bytes[a:b]) for a, b in span],
        [COMM_FLOPS_PER_BYTE * costs.cross_bytes[a] for a, _ in span],
    )


def balanced_stages(
    graph: Graph, nstages: int, pivots: tuple[str, ...] = (), whole: tuple[str, ...] = ()
) -> StageChoice:
    """The `pp`/`hybrid` policies' stages: by forward FLOPs, no memory limit."""
    choice = choose_stages(graph, nstages, lambda c: flop_segments(graph, c), pivots, whole=whole)
    assert choice is not None  # no memory limit: some split always fits
    return choice


def balanced_starts(graph: Graph, candidates: list[int], nstages: int) -> list[int]:
    """Stage starts (node indices, 0 first) among `candidates` (0 is always one), by forward FLOPs."""
    cands = sorted({0, *candidates})
    if nstages > len(cands):
        raise PlanError(
            f"pipeline_nstages={nstages} but the model has only {len(cands)} places a stage can start (the "
            "graph's start and each pivot module): use fewer stages or finer pipeline_pivots"
        )
    segs = flop_segments(graph, cands)
    need = [1 if p > 0 else 0 for p in segs.param]
    need = need if sum(need) >= nstages else None
    _, first = stage_dp_py(segs.cost, segs.act, segs.param, nstages, 1, math.inf, segs.cross, need)
    if not first:
        _, first = stage_dp_py(segs.cost, segs.act, segs.param, nstages, 1, math.inf, segs.cross, None)
    return [cands[k] for k in first]


def node_cost(node: Node, graph: Graph) -> float:
    """Forward FLOPs of one node as the balancer counts them (0 for views)."""
    index = graph_fact(
        graph, "stage_balance.node_index", lambda g: {n.name: i for i, n in enumerate(g.nodes)}
    )
    return graph_costs(graph).flops[index[node.name]]


@dataclass(frozen=True)
class StageShare:
    """One stage's share of the model's forward FLOPs and of its weights (bytes)."""

    flops: float
    params: float
    flops_share: float
    params_share: float


def stage_shares(graph: Graph, starts: list[int]) -> list[StageShare]:
    """Every stage's FLOPs and weights, and their shares of the whole (a weight two stages hold counts
    for both, so the weight shares may add up to more than 1)."""
    costs = graph_costs(graph)
    bounds = list(starts) + [len(graph.nodes)]
    flops = [sum(costs.flops[a:b]) for a, b in zip(bounds, bounds[1:])]
    params = costs.params_of(graph, list(starts))
    total_f = sum(costs.flops) or 1.0
    total_p = sum(costs.param_bytes) or 1.0
    return [StageShare(f, p, f / total_f, p / total_p) for f, p in zip(flops, params)]


def stage_summary(graph: Graph, starts: list[int]) -> str:
    """'stages: FLOPs 26%/25%/24%/25%, weights 30%/23%/23%/24%, heaviest/lightest 1.08' for logs."""
    shares = stage_shares(graph, starts)
    flops = [s.flops for s in shares]
    ratio = max(flops) / min(flops) if min(flops) > 0 else math.inf
    return (
        "stages: FLOPs "
        + "/".join(f"{s.flops_share:.0%}" for s in shares)
        + ", weights "
        + "/".join(f"{s.params_share:.0%}" for s in shares)
        + f", heaviest/lightest {ratio:.2f}"
    )


def stage_report_lines(graph: Graph, plan) -> list[str]:
    """A plan's pipeline stages as Markdown lines for a report: where each starts and its shares of the
    FLOPs and weights ([] without a pipeline)."""
    if getattr(plan, "pipeline", None) is None:
        return []
    first = set(plan.pipeline.starts)
    starts = [i for i, n in enumerate(graph.nodes) if n.name in first]
    shares = stage_shares(graph, starts)
    lines = ["", "## Pipeline stages", "", "| stage | starts at | FLOPs | weights |", "|---|---|---|---|"]
    for s, (i, share) in enumerate(zip(starts, shares)):
        where = graph.nodes[i].module_path or "(model forward)"
        lines.append(f"| {s} | {where} | {share.flops_share:.1%} | {share.params_share:.1%} |")
    summary = stage_summary(graph, starts)
    lines += ["", f"S{summary[1:]} (forward FLOPs; a weight two stages hold counts for both)."]
    return lines
