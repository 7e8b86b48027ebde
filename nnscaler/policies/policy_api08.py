"""Run an nnScaler 0.8-style policy (`policy(graph: IRGraph, cfg) -> IRGraph`) and turn what it
recorded into a Plan, the single source of truth: the same choices give the same Plan (and so the
same generated code) as a policy that returns the Plan directly.

The mapping: graph.partition(node, node.algorithm('dim'), idx, dim, num) with piece k assigned to
the k-th device of the node's stage is a split on the annotation identifier of input idx's dim;
graph.replicate(node, n) over all of the stage's devices (or one op assigned to a one-device stage)
is a replication; graph.staging(starts) + a schedule are a PipelinePlan; graph.recompute(nodes) is
Plan.recompute (the modules those nodes make up). What a Plan cannot express is refused with a
PlanError naming the call.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from nnscaler.config import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph
from nnscaler.graph.policy_api import IRGraph, IRSegment, NodeFate, PolicyRecord
from nnscaler.policies.plan import REPLICATE, SCHEDULERS, NodePlan, PipelinePlan, Plan

__all__ = ["is_policy_api08", "run_policy", "record_to_plan"]

_API08_ATTRS = ("select", "partition", "replicate", "assign", "staging", "recompute", "multiref", "segment")


def is_policy_api08(fn: Callable) -> bool:
    """Does `fn` declare nnScaler 0.8's signature (its graph parameter or its return is an IRGraph)?"""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    params = list(sig.parameters.values())
    hints = [params[0].annotation] if params else []
    hints.append(sig.return_annotation)
    for hint in hints:
        if isinstance(hint, type) and issubclass(hint, IRSegment):
            return True
        if isinstance(hint, str) and ("IRGraph" in hint or "IRSegment" in hint):
            return True
    return False


def _api08_failure(exc: Exception) -> bool:
    """Did calling a policy with our Graph fail on nnScaler 0.8's IRGraph methods?"""
    text = str(exc)
    if isinstance(exc, AttributeError):
        return "'Graph' object has no attribute" in text and any(f"'{a}'" in text for a in _API08_ATTRS)
    return isinstance(exc, TypeError) and "'tuple' object is not callable" in text


def run_policy(fn: Callable, graph: Graph, cfg: ComputeConfig) -> Any:
    """Call a custom policy: ours (`(graph, cfg) -> Plan`) with the Graph, a 0.8-style one with an
    IRGraph over it (its record becomes the Plan). An unannotated policy that fails on the 0.8 methods
    with our Graph is run again 0.8-style."""
    if not is_policy_api08(fn):
        try:
            return fn(graph, cfg)
        except (AttributeError, TypeError) as exc:
            if not _api08_failure(exc):
                raise
    name = getattr(fn, "__name__", "custom")
    front = IRGraph(graph, cfg.plan_ngpus)
    out = fn(front, cfg)
    if isinstance(out, Plan):
        return out
    if out is not front:
        raise PlanError(
            f"policy {name} returned {type(out).__name__}: an nnScaler 0.8-style policy returns the IRGraph it was given"
        )
    return record_to_plan(graph, front.record, cfg, name)


def _stage_index(graph: Graph, record: PolicyRecord) -> dict[str, int]:
    starts = set(record.stage_starts or ())
    out, stage = {}, -1
    for k, node in enumerate(graph.nodes):
        if k == 0 or node.name in starts:
            stage += 1
        out[node.name] = stage
    return out


def _fate(graph: Graph, record: PolicyRecord, node_name: str) -> NodeFate:
    fate = record.fates.get(node_name)
    node = graph.node(node_name)
    where = f"{node_name} ({node.op}{', ' + node.source if node.source else ''})"
    if fate is None:
        raise PlanError(
            f"graph.assign(...): op {where} was never assigned a device; give every op a device "
            "(graph.replicate + graph.assign on every device keeps it whole)"
        )
    missing = [k for k, d in enumerate(fate.devices) if d is None]
    if missing:
        raise PlanError(f"graph.assign(...): pieces {missing} of {fate.call} ({where}) were never assigned")
    return fate


def _node_plan(name: str, fate: NodeFate, devices: list[int]) -> NodePlan:
    got = list(fate.devices)
    if fate.kind in ("whole", "replicate") or fate.num == 1:
        if sorted(got) != devices:
            raise PlanError(
                f"graph.assign(...): {fate.call} runs {name} on devices {got}, but its stage runs on "
                f"devices {devices}; a Plan keeps a whole op on every device of its stage"
            )
        return REPLICATE
    if fate.num != len(devices):
        raise PlanError(
            f"{fate.call}: {fate.num} pieces over the {len(devices)} devices {devices} of its stage; a Plan "
            "splits an op into one piece per device (several pieces per device, or pieces on only some "
            "devices, cannot be expressed)"
        )
    if got != devices:
        raise PlanError(
            f"graph.assign(...): the pieces of {fate.call} go to devices {got} (in piece order); a Plan puts "
            f"piece k on the k-th device of the stage, {devices}"
        )
    return NodePlan(fate.ident, fate.num)


def _stage_groups(sets: list[tuple[int, ...]], plan_ngpus: int, staged: bool, record: PolicyRecord) -> int:
    """pp_size: stage s must run on device group s % pp_size (consecutive blocks of the plan devices)."""
    distinct = list(dict.fromkeys(sets))
    pp = len(distinct) if staged else 1
    tp = plan_ngpus // pp if plan_ngpus % pp == 0 else 0
    for s, got in enumerate(sets):
        want = tuple(range((s % pp) * tp, (s % pp + 1) * tp)) if tp else ()
        if got != want:
            where = f"stage {s} of {record.staging_call}" if staged else "the graph (no graph.staging)"
            raise PlanError(
                f"graph.assign(...): {where} runs on devices {list(got)}; a Plan runs it on devices "
                f"{list(want) or '(none: plan_ngpus is not a multiple of the device groups)'} (every op on "
                "all plan devices without stages; stage s on the (s % pp_size)-th block of plan_ngpus // "
                "pp_size consecutive devices with them)"
            )
    return pp


def _pipeline(record: PolicyRecord, pp: int, cfg: ComputeConfig) -> PipelinePlan | None:
    starts, sched = record.stage_starts, record.schedule
    if starts is None:
        if sched is not None:
            raise PlanError(f"{sched.call}: a pipeline schedule needs stages; call graph.staging(...) first")
        return None
    if sched is None:
        raise PlanError(
            f"{record.staging_call}: a staged graph needs a schedule: "
            "cfg.apply_pipeline_scheduler(graph, nstages, nmicros, scheduler)"
        )
    if sched.scheduler not in SCHEDULERS:
        raise PlanError(
            f"{sched.call}: schedule {sched.scheduler!r} is not one we run; use one of {SCHEDULERS}"
        )
    if sched.nstages != len(starts):
        raise PlanError(
            f"{sched.call}: nstages={sched.nstages} but {record.staging_call} made {len(starts)} stages"
        )
    if not cfg.use_end2end:
        raise PlanError(
            f"{sched.call}: pipelines run in end-to-end mode; set ComputeConfig(use_end2end=True)"
        )
    return PipelinePlan(tuple(starts), pp, sched.nmicros, sched.scheduler)


def record_to_plan(graph: Graph, record: PolicyRecord, cfg: ComputeConfig, name: str) -> Plan:
    """The Plan a 0.8-style policy's record means (PlanError naming the call it cannot express)."""
    stage_of = _stage_index(graph, record)
    nstages = max(stage_of.values(), default=0) + 1
    fates = {n.name: _fate(graph, record, n.name) for n in graph.nodes}
    used: list[set[int]] = [set() for _ in range(nstages)]
    for node_name, fate in fates.items():
        used[stage_of[node_name]].update(fate.devices)
    sets = [tuple(sorted(u)) for u in used]
    pp = _stage_groups(sets, cfg.plan_ngpus, record.stage_starts is not None, record)
    nodes = {n: _node_plan(n, fates[n], list(sets[stage_of[n]])) for n in fates}
    recompute = _recompute_paths(graph, record)
    return Plan(name, cfg.plan_ngpus, nodes, recompute=recompute, pipeline=_pipeline(record, pp, cfg))


def _recompute_paths(graph: Graph, record: PolicyRecord) -> tuple[str, ...]:
    """The modules each graph.recompute group makes up: for each op, its outermost enclosing module
    whose ops are all in the group. A group that is not whole modules is refused."""
    by_module: dict[str, set[str]] = {}
    for node in graph.nodes:
        parts = node.module_path.split(".") if node.module_path else []
        for k in range(len(parts) + 1):
            by_module.setdefault(".".join(parts[:k]), set()).add(node.name)
    paths: set[str] = set()
    for names, call in record.recompute_groups:
        group = set(names)
        for node_name in names:
            parts = graph.node(node_name).module_path.split(".") if graph.node(node_name).module_path else []
            prefixes = [".".join(parts[:k]) for k in range(len(parts) + 1)]
            whole = [p for p in prefixes if by_module[p] <= group]
            if not whole:
                raise PlanError(
                    f"{call}: op {node_name} is in module {'.'.join(parts) or '(root)'}, whose other ops are "
                    "not in the group; Plan.recompute takes whole modules (recompute every op of a module)"
                )
            paths.add(whole[0])
    outer = [
        p for p in sorted(paths) if not any(q != p and (q == "" or p.startswith(q + ".")) for q in paths)
    ]
    return tuple(sorted(outer, key=lambda p: [int(x) if x.isdigit() else x for x in p.split(".")]))
