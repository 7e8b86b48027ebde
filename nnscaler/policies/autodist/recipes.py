"""Standard recipes costed with the same model, for the report: data parallel with ZeRO 1/2/3, and
Megatron-style tensor parallel x pipeline (1F1B) x data parallel over all valid degrees."""

from __future__ import annotations

from dataclasses import dataclass, replace

from nnscaler.config import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph
from nnscaler.policies.autodist.evaluate import evaluate_nodes
from nnscaler.policies.autodist.layers import layer_instances
from nnscaler.policies.autodist.search import Candidate, PlannerSetup, _ctx, _transient, divisors
from nnscaler.policies.staging import balanced_starts
from nnscaler.policies.tp import pas_tp

__all__ = ["Recipe", "standard_recipes"]


@dataclass
class Recipe:
    name: str
    candidate: Candidate
    fits: bool


def _scale(setup: PlannerSetup, dp: int) -> float:
    """Micro-batch scale keeping the global batch: `dp` replicas share what setup.dp_size replicas take."""
    return setup.batch_scale * setup.dp_size / dp


def _fit(graph: Graph, s: PlannerSetup, nodes, pp: int, starts, m: int, layers: tuple[str, ...]):
    """The recipe as it is, or with every layer recomputed when that is what makes it fit."""
    transient = _transient(graph, _ctx(s, s.plan_ngpus // pp), s)
    cand = evaluate_nodes(graph, s, nodes, pp=pp, starts=starts, nmicros=m)
    if cand.memory + transient <= s.mem_limit or not layers:
        return cand, cand.memory + transient <= s.mem_limit, ""
    rc = evaluate_nodes(graph, s, nodes, pp=pp, starts=starts, nmicros=m, recompute=layers)
    if rc.memory + transient <= s.mem_limit:
        return rc, True, " + recompute"
    return cand, False, ""


def standard_recipes(graph: Graph, setup: PlannerSetup, ndevices: int, nmicros: int = 1) -> list[Recipe]:
    """DP+ZeRO over `ndevices`, and Megatron TP x PP x DP splitting them (tp within a node), each taking
    the same global batch as `setup` (setup.dp_size replicas of the traced batch x nmicros); a recipe
    that does not fit in memory is tried again with every layer recomputed."""
    out: list[Recipe] = []
    _, instances = layer_instances(graph, setup.pivots)
    layers = tuple(p for p, _ in instances)
    layer_starts = [idx[0] for _, idx in instances]
    for zero in (1, 2, 3):
        s = replace(
            setup,
            plan_ngpus=1,
            dp_size=ndevices,
            memory=replace(setup.memory, zero_stage=zero),
            batch_scale=_scale(setup, ndevices),
        )
        cand, fits, rc = _fit(graph, s, {}, 1, None, nmicros, layers)
        out.append(Recipe(f"DP x{ndevices} + ZeRO-{zero}{rc}", cand, fits))
    for tp in divisors(ndevices):
        if tp > setup.cluster.devices_per_node:
            continue
        tp_nodes = pas_tp(graph, ComputeConfig(tp, tp)).nodes if tp > 1 else {}
        for pp in divisors(ndevices // tp):
            if pp > 1 and (not setup.end2end or pp > len(layer_starts)):
                continue
            dp = ndevices // (tp * pp)
            if tp == 1 and pp == 1:
                continue
            s = replace(setup, plan_ngpus=tp * pp, dp_size=dp, batch_scale=_scale(setup, dp))
            m = max(nmicros, pp) if pp > 1 else nmicros
            try:
                starts = balanced_starts(graph, layer_starts[1:], pp) if pp > 1 else None
                cand, fits, rc = _fit(graph, s, tp_nodes, pp, starts, m, layers)
            except PlanError:
                continue
            out.append(Recipe(f"Megatron TP{tp} x PP{pp} x DP{dp}{rc}", cand, fits))
    return out
