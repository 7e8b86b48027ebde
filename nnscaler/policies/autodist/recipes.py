"""Standard recipes costed with the same model, for the report: data parallel with ZeRO 1/2/3, and
Megatron-style tensor parallel x pipeline (1F1B) x data parallel over all valid degrees."""

from __future__ import annotations

from dataclasses import dataclass, replace

from nnscaler.config import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph
from nnscaler.policies.autodist.candidate import Candidate
from nnscaler.policies.autodist.context import PlannerSetup, stage_context, transient_bytes
from nnscaler.policies.autodist.evaluate import evaluate_nodes
from nnscaler.policies.autodist.layers import layer_instances
from nnscaler.policies.autodist.search import divisors, micro_options
from nnscaler.policies.staging import balanced_starts
from nnscaler.policies.tp import pas_tp

__all__ = ["Recipe", "standard_recipes"]


@dataclass
class Recipe:
    name: str
    candidate: Candidate
    fits: bool


def _scale(setup: PlannerSetup, dp: int, m: int = 1) -> float:
    """Micro-batch scale keeping the global batch: `dp` replicas share what setup.dp_size replicas take
    (offline: the traced batch is the whole step's, split over dp replicas x m micro-batches)."""
    if setup.global_batch:
        return 1.0 / (dp * m)
    return setup.batch_scale * setup.dp_size / dp


def _options(setup: PlannerSetup, dp: int, nmicros: int, pp: int) -> list[int]:
    if setup.global_batch:
        return [m for m in micro_options(replace(setup, nmicros=None), dp) if m >= pp] or [pp]
    return [max(nmicros, pp) if pp > 1 else nmicros]


def _fit(graph: Graph, s: PlannerSetup, nodes, pp: int, starts, m: int, layers: tuple[str, ...]):
    """The recipe as it is, or with every layer recomputed when that is what makes it fit."""
    transient = transient_bytes(graph, stage_context(s, s.plan_ngpus // pp), s)
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
        out.append(Recipe(f"DP x{ndevices} + ZeRO-{zero}{best[2]}{_mb(setup, best[3])}", best[0], best[1]))
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
            best = None
            for m in _options(setup, dp, nmicros, pp):
                s = replace(setup, plan_ngpus=tp * pp, dp_size=dp, batch_scale=_scale(setup, dp, m))
                try:
                    starts = balanced_starts(graph, layer_starts[1:], pp) if pp > 1 else None
                    best = _better(best, _fit(graph, s, tp_nodes, pp, starts, m, layers), m)
                except PlanError:
                    continue
            if best is not None:
                name = f"Megatron TP{tp} x PP{pp} x DP{dp}{best[2]}{_mb(setup, best[3])}"
                out.append(Recipe(name, best[0], best[1]))
    return out


def _better(best, new, m: int):
    """Keep the fitting, faster one of (candidate, fits, suffix, nmicros) tuples."""
    cand, fits, rc = new
    item = (cand, fits, rc, m)
    if best is None or (fits and not best[1]) or (fits == best[1] and cand.step_time < best[0].step_time):
        return item
    return best


def _mb(setup: PlannerSetup, m: int) -> str:
    return f", {m} micro-batches" if setup.global_batch else ""
