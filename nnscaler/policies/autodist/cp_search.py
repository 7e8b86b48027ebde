"""Context parallelism in the search: every cp degree c (dividing a stage's devices) x kind.

For each degree the existing search (tp mesh x pipeline x recompute x micro-batches) plans the
devices left over, `plan_ngpus / c`, as the per-rank problem (`reduced_setup`): every activation that
carries the batch is 1/c as large (batch_scale), so each token-wise op does and keeps 1/c (attention
too: 1/c of the queries against the whole sequence); weights are replicated over cp, so their
gradients are reduced over cp x dp (dp_size grows c-fold, ZeRO shards over both). Each kind then adds
its communication and imbalance (autodist/context_parallel.py). The winner's Plan is the tp plan of
the remaining devices composed with the sequence split (policies/context_parallel.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph
from nnscaler.graph.ops import annotate_node
from nnscaler.policies.autodist.candidate import Candidate
from nnscaler.policies.autodist.constraints import describe_node
from nnscaler.policies.autodist.context import PlannerSetup, stage_context
from nnscaler.policies.autodist.context_parallel import (
    attention_calls,
    cp_cost,
    kind_refusal,
    sequence_length,
)
from nnscaler.policies.autodist.ep_search import ep_tp_part, evaluate_ep_plan, plan_ep_degree
from nnscaler.policies.autodist.evaluate import evaluate_plan
from nnscaler.policies.autodist.memo import graph_memo
from nnscaler.policies.context_parallel import attention_nodes, sequence_plans, with_context_parallel
from nnscaler.policies.plan import CP_KINDS, ContextParallel, Plan

__all__ = [
    "reduced_setup",
    "cp_search",
    "cp_options",
    "cost_with_cp",
    "plan_with_cp",
    "tp_part",
    "evaluate_cp_plan",
    "evaluate_any_plan",
    "NOT_TAKEN",
]

NOT_TAKEN = "autodist: not taken: "
"""Prefix of the plan notes that say why a context-parallel degree or kind was not taken (report_cp.py)."""

MIN_TOKENS_PER_CP_RANK = 4096
"""cp_size 'auto' tries degree c only while each rank keeps at least this many tokens: shorter ring blocks
hide no exchange, and a split of so few tokens is what data parallelism gives without attention
traffic (it also keeps the search from multiplying for short sequences). A pinned cp_size is tried."""

Search = Callable[[Graph, PlannerSetup], tuple[Candidate, list[Candidate]]]


def reduced_setup(setup: PlannerSetup, c: int) -> PlannerSetup:
    """The per-rank problem of cp degree `c`: plan_ngpus / c devices, 1/c of the tokens, weights'
    gradients reduced over c x dp replicas. Under tp_mesh 'auto', tensor parallelism of 8 or more
    devices beside cp stays 1-D (a cp axis on a 3-axis tp mesh would make four)."""
    if c == 1:
        return replace(setup, cp_size=1)
    tp_mesh = "off" if setup.tp_mesh == "auto" and setup.plan_ngpus // c >= 8 else setup.tp_mesh
    return replace(
        setup,
        plan_ngpus=setup.plan_ngpus // c,
        dp_size=setup.dp_size * c,
        batch_scale=setup.batch_scale / c,
        cp_size=1,
        cp_degree=c,
        tp_mesh=tp_mesh,
    )


def _sequence_splits(graph: Graph, setup: PlannerSetup, c: int) -> str | None:
    """Why the sequence cannot be split c ways through the model, or a partition constraint forbids
    it for an op it splits (None: it can); the splits memoised per graph."""
    memo = graph_memo(graph).setdefault("cp_sequence_splits", {})
    if c not in memo:
        try:
            memo[c] = sequence_plans(graph, c)
        except PlanError as exc:
            memo[c] = str(exc)
    if isinstance(memo[c], str) or not setup.constraints:
        return memo[c] if isinstance(memo[c], str) else None
    for node in graph.nodes:
        p = memo[c].get(node.name)
        if (
            p is not None
            and p.is_split
            and not setup.constraints.allows(graph, node, annotate_node(node, graph), p)
        ):
            return (
                f"the partition constraints forbid splitting {describe_node(graph, node)} by sequence "
                f"(identifier {p.split!r}), which context parallelism does"
            )
    return None


def _degrees(graph: Graph, setup: PlannerSetup) -> tuple[list[int], list[tuple[str, str]]]:
    """cp degrees to search and (degree, why not) for the others; PlanError for a pin that cannot hold."""
    n, pinned = setup.plan_ngpus, setup.cp_size
    if pinned == 1 or (pinned is None and n == 1):
        return [1], []
    seq = sequence_length(graph) if attention_nodes(graph) else None
    if seq is None:
        if pinned:
            raise PlanError(
                f"autodist: pas_config['cp_size']={pinned} but the model has no self-attention of one sequence "
                "length to split by sequence; drop cp_size (or set it to 1)"
            )
        return [1], []
    if pinned is None and isinstance(setup.tp_mesh, tuple):
        why = (
            "pas_config['tp_mesh'] pins the mesh of a stage's devices; give cp_size too to split the sequence"
        )
        return [1], [("cp>1", why)]
    if pinned and n % pinned:
        raise PlanError(
            f"autodist: pas_config['cp_size']={pinned} does not divide plan_ngpus={n}; use a divisor of {n}"
        )
    if not pinned and seq < 2 * MIN_TOKENS_PER_CP_RANK:
        return [1], []  # too short for any cp degree: no context-parallel section in the report
    degrees, rejected = [], []
    for c in [pinned] if pinned else [d for d in range(1, n + 1) if n % d == 0]:
        if not pinned and seq < c * MIN_TOKENS_PER_CP_RANK:
            rejected.append(
                (f"cp={c}", f"under {MIN_TOKENS_PER_CP_RANK} tokens per rank (pin cp_size to try it)")
            )
            continue
        why = None if c == 1 else (f"the sequence ({seq}) is not divisible by {c}" if seq % c else None)
        why = why or (None if c == 1 else _sequence_splits(graph, setup, c))
        if why and pinned:
            raise PlanError(f"autodist: pas_config['cp_size']={c} cannot be planned: {why}")
        if why:
            rejected.append((f"cp={c}", why))
        else:
            degrees.append(c)
    return degrees, rejected


def cp_options(setup: PlannerSetup, c: int) -> list[ContextParallel]:
    """The kinds (and hybrid's Ulysses group sizes) costed at degree `c`."""
    kinds = [setup.cp_kind] if setup.cp_kind else list(CP_KINDS)
    out = []
    for kind in kinds:
        if kind != "hybrid":
            out.append(ContextParallel(c, kind))
            continue
        sizes = [setup.cp_ulysses_size] if setup.cp_ulysses_size else [u for u in range(2, c) if c % u == 0]
        out += [ContextParallel(c, kind, u) for u in sizes if 1 < u < c and c % u == 0]
    if not out:
        raise PlanError(
            f"autodist: cp_kind {setup.cp_kind!r} cannot run over {c} devices (cp_ulysses_size "
            f"{setup.cp_ulysses_size}): 'hybrid' needs a Ulysses group size strictly between 1 and {c} "
            "that divides it; use another cp_kind or cp_size"
        )
    return out


def cost_with_cp(graph: Graph, sub: PlannerSetup, cand: Candidate, cp: ContextParallel) -> Candidate | str:
    """`cand` (a configuration of the per-rank problem `sub`) with `cp`'s cost added, or why it cannot run."""
    ctx = stage_context(sub, cand.tp, pipelined=cand.pp > 1)
    calls = attention_calls(graph, ctx, cand.spmd)
    why = kind_refusal(calls, cp, sequence_length(graph) or 0)
    if why:
        return why
    cost = cp_cost(calls, cp, sub.cluster, cand.tp, cand.recompute)
    slots = cand.nmicros if cand.pp == 1 else (cand.nmicros + cand.pp - 1) / cand.pp
    return replace(
        cand,
        cp=cp,
        step_time=cand.step_time + cost.exposed * slots,
        cp_comm=cost.comm * cand.nmicros / cand.pp,
        cp_exposed=cost.exposed * slots,
    )


def _order(c: Candidate) -> tuple:
    return (c.time_per_micro, c.pp, c.cp_size, -c.tp, c.recompute)


def cp_search(graph: Graph, setup: PlannerSetup, inner: Search) -> tuple[Candidate, list[Candidate]]:
    """The best configuration over cp degrees and kinds (`inner`: the search of one per-rank problem)."""
    degrees, rejected = _degrees(graph, setup)
    if degrees == [1] and not rejected:
        return inner(graph, setup)
    scored: list[Candidate] = []
    best_of: dict[str, Candidate] = {}
    errors: list[PlanError] = []
    for c in degrees:
        try:
            _, found = _memo_search(graph, reduced_setup(setup, c), inner)
        except PlanError as exc:
            errors.append(exc)
            rejected.append((f"cp={c}", str(exc).removeprefix("autodist: ")))
            continue
        options = [None] if c == 1 else cp_options(setup, c)
        for cp in options:
            costed = [
                replace(x) if cp is None else cost_with_cp(graph, reduced_setup(setup, c), x, cp)
                for x in found
            ]
            ok = [x for x in costed if isinstance(x, Candidate)]
            key = f"cp={c}" + (f" ({ok[0].cp_label() if ok else cp.kind})" if cp else "")
            if not ok:
                rejected.append((key, str(costed[0]) if costed else "no configuration planned"))
                continue
            scored += ok
            best_of[key] = min(ok, key=_order)
    if not scored:
        raise _nothing_planned(degrees, errors, rejected)
    best = min(scored, key=_order)
    best.cp_rejected = tuple(_slower(best, best_of)) + tuple(rejected)
    return best, scored


def _memo_search(graph: Graph, sub: PlannerSetup, inner: Search) -> tuple[Candidate, list[Candidate]]:
    """`inner` on a per-rank problem, memoised per graph: cp degree c over p devices is the problem of
    p / c devices with c times the replicas, which offline planning also meets as the plan size p / c
    (its candidates are shared: callers copy before changing one)."""
    memo = graph_memo(graph).setdefault("cp_inner_search", {})
    plain = replace(
        sub, measured=None, batch_scale=0.0, cp_degree=1, cp_size=1, cp_kind=None, cp_ulysses_size=None
    )
    key = (repr(plain), round(sub.batch_scale, 12), id(sub.measured))
    if key not in memo:
        try:
            memo[key] = inner(graph, sub)
        except PlanError as exc:
            memo[key] = exc
    if isinstance(memo[key], PlanError):
        raise memo[key]
    return memo[key]


def _nothing_planned(degrees: list[int], errors: list[PlanError], rejected) -> PlanError:
    """The first degree's error (cp 1's where it was tried), then one line per other degree."""
    if not errors:
        why = "; ".join(f"{k}: {w}" for k, w in rejected)
        return PlanError(f"autodist: no context-parallel degree or kind could be planned ({why})")
    first = f"cp={degrees[0]}"
    others = [f"  - {k}: {w.splitlines()[0]}" for k, w in rejected if k != first]
    tail = "\nwith the sequence split over more devices (context parallelism):\n" + "\n".join(others)
    return PlanError(str(errors[0]) + (tail if others else ""))


def _slower(best: Candidate, best_of: dict[str, Candidate]) -> list[tuple[str, str]]:
    """(configuration, why not taken) for the best candidate of every other cp degree and kind."""
    out = []
    for key, x in sorted(best_of.items(), key=lambda kv: kv[1].step_time):
        if x is best:
            continue
        gap = x.time_per_micro - best.time_per_micro
        why = f"predicted {x.step_time * 1e3:.3f} ms per step ({x.label()}), {gap * x.nmicros * 1e3:+.3f} ms"
        if x.cp is None:
            why += ": without a sequence split each device holds and computes all of its sequence"
        elif x.cp_exposed > 0:
            what = (
                "ring exchanges not hidden and the causal mask's imbalance (the last rank does ~2x the average)"
                if x.cp.kind == "ring"
                else "all-to-alls that are not overlapped"
                if x.cp.kind == "ulysses"
                else "ring exchanges not hidden behind attention and its all-to-alls"
            )
            why += f"; its context parallelism adds {x.cp_exposed * 1e3:.3f} ms per step ({what})"
        out.append((key, why))
    return out


def plan_with_cp(
    graph: Graph, cand: Candidate, setup: PlannerSetup, tp_plan: Callable[[PlannerSetup], Plan]
) -> Plan:
    """The Plan of a cp candidate: `tp_plan(reduced setup)` composed with the sequence split; the
    other degrees and kinds, and why they were not taken, as notes."""
    cp = cand.cp
    plan = tp_plan(reduced_setup(setup, cp.size) if cp else setup)
    if cp is not None:
        plan = with_context_parallel(graph, plan, cp)
    notes = tuple(f"{NOT_TAKEN}{key}: {why}" for key, why in cand.cp_rejected)
    return replace(plan, notes=plan.notes + notes)


def tp_part(plan: Plan) -> Plan:
    """A cp plan's tensor-parallel part over the devices left to it (mesh axis 0, the sequence, dropped:
    the same cut as an ep plan's)."""
    return ep_tp_part(plan, plan.context_parallel.size)


def evaluate_cp_plan(graph: Graph, setup: PlannerSetup, plan: Plan) -> Candidate:
    """Re-cost a plan with context parallelism: its tp part as the per-rank problem, plus the cp cost."""
    cp = plan.context_parallel
    sub = reduced_setup(setup, cp.size)
    cand = evaluate_plan(graph, sub, tp_part(plan))
    out = cost_with_cp(graph, sub, cand, ContextParallel(cp.size, cp.kind, cp.ulysses_size))
    if isinstance(out, str):
        raise PlanError(f"autodist: the plan's {cp.describe()} cannot run: {out}")
    return out


def evaluate_any_plan(graph: Graph, setup: PlannerSetup, plan: Plan) -> Candidate:
    """evaluate_plan, or evaluate_cp_plan / evaluate_ep_plan for a plan with context / expert parallelism."""
    ep = plan_ep_degree(graph, plan)
    if ep > 1:
        return evaluate_ep_plan(graph, setup, plan, ep)
    return (
        evaluate_cp_plan(graph, setup, plan) if plan.context_parallel else evaluate_plan(graph, setup, plan)
    )
