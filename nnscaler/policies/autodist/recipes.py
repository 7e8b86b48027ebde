"""Standard recipes costed with the same model, for the report: data parallel with ZeRO 1/2/3, and
Megatron-style tensor parallel x pipeline (1F1B) x data parallel over all valid degrees; each says
which of the search's limits it breaks (memory, a user constraint), so the report can say why a faster
recipe was not taken."""

from __future__ import annotations

from dataclasses import dataclass, replace

from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph
from nnscaler.graph.ops import annotate_node
from nnscaler.policies.autodist.candidate import Candidate
from nnscaler.policies.autodist.constraints import PartitionConstraints
from nnscaler.policies.autodist.context import PlannerSetup, stage_context, transient_bytes
from nnscaler.policies.autodist.ep_search import cost_with_ep, ep_setup
from nnscaler.policies.autodist.evaluate import evaluate_nodes
from nnscaler.policies.autodist.layers import layer_instances
from nnscaler.policies.autodist.memo import tp_policy_nodes
from nnscaler.policies.autodist.search import divisors, micro_options
from nnscaler.policies.expert_parallel import experts_nodes
from nnscaler.policies.plan import REPLICATE, NodePlan
from nnscaler.policies.stage_balance import balanced_starts

__all__ = ["Recipe", "standard_recipes"]


@dataclass
class Recipe:
    name: str
    candidate: Candidate
    fits: bool
    dp: int = 1
    zero: int = 0
    """ZeRO stage the recipe is costed with."""
    peak: float = 0.0
    """Bytes on the fullest device, transient buffers included (what `fits` compares to the limit)."""
    excluded: tuple[str, ...] = ()
    """Why the search could not take this recipe: memory, or the user constraints it breaks."""


def _scale(setup: PlannerSetup, dp: int, m: int = 1) -> float:
    """Micro-batch scale keeping the global batch: `dp` replicas share what setup.dp_size replicas take
    (offline: the traced batch is the whole step's, split over dp replicas x m micro-batches)."""
    if setup.global_batch:
        return 1.0 / (dp * m)
    return setup.batch_scale * setup.dp_size / dp


def _options(setup: PlannerSetup, dp: int, nmicros: int, pp: int) -> list[int]:
    """Micro-batch counts a recipe tries: the request's (`--nmicros` / pipeline_nmicros), as the search
    does, else (a fixed global batch) the search's own choices; never fewer than its stages."""
    if setup.global_batch and setup.nmicros:
        return [max(setup.nmicros, pp)]
    if setup.global_batch:
        return [m for m in micro_options(replace(setup, nmicros=None), dp) if m >= pp] or [pp]
    return [max(nmicros, pp) if pp > 1 else nmicros]


def _too_many_replicas(setup: PlannerSetup, dp: int) -> bool:
    """Offline (the traced batch is the step's): more data-parallel replicas than sequences, which the
    search refuses too (offline.py: a replica needs a whole sample; only cp splits sequences)."""
    return setup.global_batch and dp > max(setup.traced_batch, 1)


def _fit(graph: Graph, s: PlannerSetup, nodes, pp: int, starts, m: int, layers: tuple[str, ...]):
    """The recipe as it is, or with every layer recomputed when that is what makes it fit."""
    transient = transient_bytes(graph, stage_context(s, s.plan_ngpus // pp), s)
    cand = evaluate_nodes(graph, s, nodes, pp=pp, starts=starts, nmicros=m)
    cand.zero = s.memory.zero_stage
    if cand.memory + transient <= s.mem_limit or not layers:
        return cand, cand.memory + transient <= s.mem_limit, "", cand.memory + transient
    rc = evaluate_nodes(graph, s, nodes, pp=pp, starts=starts, nmicros=m, recompute=layers)
    rc.zero = s.memory.zero_stage
    if rc.memory + transient <= s.mem_limit:
        return rc, True, " + recompute", rc.memory + transient
    return cand, False, "", cand.memory + transient


def standard_recipes(graph: Graph, setup: PlannerSetup, ndevices: int, nmicros: int = 1) -> list[Recipe]:
    """DP+ZeRO over `ndevices`, and Megatron TP x PP x DP splitting them (tp within a node), each taking
    the same global batch as `setup` (setup.dp_size replicas of the traced batch x nmicros); a recipe
    that does not fit in memory is tried again with every layer recomputed. Offline, none has more
    data-parallel replicas than the traced batch has samples (the search refuses them too)."""
    out: list[Recipe] = []
    _, instances = layer_instances(graph, setup.pivots)
    layers = tuple(p for p, _ in instances)
    layer_starts = [idx[0] for _, idx in instances]
    for zero in (1, 2, 3) if not _too_many_replicas(setup, ndevices) else ():
        best = None
        for m in _options(setup, ndevices, nmicros, 1):
            s = replace(
                setup,
                plan_ngpus=1,
                dp_size=ndevices,
                memory=replace(setup.memory, zero_stage=zero),
                batch_scale=_scale(setup, ndevices, m),
            )
            best = _better(best, _fit(graph, s, {}, 1, None, m, layers), m)
        name = f"DP x{ndevices} + ZeRO-{zero}{best[2]}{_mb(setup, best[3])}"
        out.append(_recipe(graph, setup, name, best, ndevices, {}))
    for tp in divisors(ndevices):
        if tp > setup.cluster.devices_per_node:
            continue
        tp_nodes = tp_policy_nodes(graph, tp) if tp > 1 else {}
        for pp in divisors(ndevices // tp):
            if pp > 1 and (not setup.end2end or pp > len(layer_starts)):
                continue
            dp = ndevices // (tp * pp)
            if (tp == 1 and pp == 1) or _too_many_replicas(setup, dp):
                continue
            best = None
            for m in _options(setup, dp, nmicros, pp):
                s = replace(setup, plan_ngpus=tp * pp, dp_size=dp, batch_scale=_scale(setup, dp, m))
                try:
                    starts = balanced_starts(graph, layer_starts[1:], pp) if pp > 1 else None
                    best = _better(best, _fit(graph, s, tp_nodes, pp, starts, m, layers), m)
                except PlanError:
                    continue
            if best is not None:
                moe = " (experts split by tp)" if tp > 1 and experts_nodes(graph) else ""
                name = f"Megatron TP{tp} x PP{pp} x DP{dp}{moe}{best[2]}{_mb(setup, best[3])}"
                out.append(_recipe(graph, setup, name, best, dp, tp_nodes))
    return out + _ep_recipes(graph, setup, ndevices, nmicros, layers)


def _ep_recipes(graph: Graph, setup: PlannerSetup, ndevices: int, nmicros: int, layers) -> list[Recipe]:
    """Expert parallel EP x Megatron TP x DP (no pipeline) for every ep dividing every layer's experts,
    tp within a node: the tp recipe's splits over tp devices, costed as the per-rank problem of
    ep x tp devices plus the all-to-alls (autodist/expert_parallel.py)."""
    nodes = experts_nodes(graph)
    if not nodes:
        return []
    experts = {annotate_node(n, graph).sizes["e"] for n in nodes}
    out = []
    for ep in (d for d in divisors(ndevices) if d > 1 and all(e % d == 0 for e in experts)):
        for tp in (t for t in divisors(ndevices // ep) if t <= setup.cluster.devices_per_node):
            dp = ndevices // (ep * tp)
            if _too_many_replicas(setup, dp * ep):  # ep splits the batch as replicas do
                continue
            tp_nodes = tp_policy_nodes(graph, tp) if tp > 1 else {}
            best = None
            for m in _options(setup, dp * ep, nmicros, 1):
                real = replace(setup, plan_ngpus=ep * tp, dp_size=dp, batch_scale=_scale(setup, dp, m))
                sub = ep_setup(real, ep)
                try:
                    fit = _fit_ep(graph, real, sub, tp_nodes, m, layers, ep)
                except PlanError:
                    continue
                best = _better(best, fit, m)
            if best is not None:
                name = f"EP{ep} x TP{tp} x DP{dp}{best[2]}{_mb(setup, best[3])}"
                out.append(_recipe(graph, setup, name, best, dp, tp_nodes))
    return out


def _fit_ep(graph: Graph, real: PlannerSetup, sub: PlannerSetup, nodes, m: int, layers, ep: int):
    """_fit of an ep recipe: the per-rank problem's cost plus ep's, recomputed where that makes it fit."""
    transient = transient_bytes(graph, stage_context(sub, sub.plan_ngpus), sub)
    fits = []
    for rc in ((), layers) if layers else ((),):
        cand = cost_with_ep(graph, sub, evaluate_nodes(graph, sub, nodes, nmicros=m, recompute=rc), ep)
        cand.zero = real.memory.zero_stage
        fits.append(
            (
                cand,
                cand.memory + transient <= real.mem_limit,
                " + recompute" if rc else "",
                cand.memory + transient,
            )
        )
        if fits[-1][1]:
            return fits[-1]
    return fits[0]


def _better(best, new, m: int):
    """Keep the fitting, faster one of (candidate, fits, suffix, nmicros, peak) tuples."""
    cand, fits, rc, peak = new
    item = (cand, fits, rc, m, peak)
    if best is None or (fits and not best[1]) or (fits == best[1] and cand.step_time < best[0].step_time):
        return item
    return best


def _mb(setup: PlannerSetup, m: int) -> str:
    return f", {m} micro-batches" if setup.global_batch else ""


def _recipe(
    graph: Graph, setup: PlannerSetup, name: str, best, dp: int, nodes: dict[str, NodePlan]
) -> Recipe:
    cand, fits, _, _, peak = best
    r = Recipe(name, cand, fits, dp, cand.zero, peak)
    r.excluded = exclusions(graph, setup, r, nodes)
    return r


def exclusions(graph: Graph, setup: PlannerSetup, r: Recipe, nodes: dict[str, NodePlan]) -> tuple[str, ...]:
    """What keeps the search (run with `setup`) from taking recipe `r` (per-node splits `nodes`)."""
    c, out = r.candidate, []
    if not r.fits:
        out.append(
            f"does not fit memory: {r.peak / 1e9:.4g} GB on its fullest device > limit {setup.mem_limit / 1e9:.4g} GB"
        )
    size = c.pp * c.tp * c.ep
    if not setup.global_batch and size != setup.plan_ngpus:  # offline planning searches the plan size
        out.append(
            f"plan_ngpus={setup.plan_ngpus} (the ComputeConfig) fixes the plan size; it plans over {size}"
        )
    if setup.recompute and tuple(c.recompute_paths) != tuple(setup.recompute):
        what = "every layer" if c.recompute_paths else "nothing"
        asked = ", ".join(setup.recompute[:2]) + (
            f" ... ({len(setup.recompute)} modules)" if len(setup.recompute) > 2 else ""
        )
        out.append(f"recompute_modules asks to recompute {asked}; it recomputes {what}")
    if setup.nstages is not None and c.pp != setup.nstages:
        out.append(f"pipeline_nstages={setup.nstages}; it has {c.pp} stage(s)")
    if setup.nmicros is not None and not setup.global_batch and c.nmicros != setup.nmicros:
        out.append(f"pipeline_nmicros={setup.nmicros}; it runs {c.nmicros} micro-batches")
    if not setup.global_batch and r.dp > 1 and r.zero != setup.memory.zero_stage:
        out.append(
            f"ZeRO stage {setup.memory.zero_stage} (ComputeConfig use_zero/zero_stage, pas_config['zero_stage']); "
            f"it uses ZeRO-{r.zero}"
        )
    broken = _broken_rule(graph, setup, nodes)
    if broken:
        out.append(broken)
    return tuple(out)


def _broken_rule(graph: Graph, setup: PlannerSetup, nodes: dict[str, NodePlan]) -> str:
    """The first partition constraint (pas_config['partition_constraints']) the recipe's splits break."""
    if not setup.constraints:
        return ""
    for node in graph.nodes:
        plan = nodes.get(node.name, REPLICATE)
        plan = plan if plan.is_split else REPLICATE
        bound = annotate_node(node, graph)
        rule = next(
            (
                r
                for r in setup.constraints.rules
                if not PartitionConstraints((r,)).allows(graph, node, bound, plan)
            ),
            None,
        )
        if rule is None:
            continue
        where = f" in {rule.parent_module}" if rule.parent_module else ""
        split = "replicates it" if plan is REPLICATE else f"splits it on {plan.describe()}"
        return f"partition constraint on {rule.name}{where} (op {node.name}): the recipe {split}"
    return ""
