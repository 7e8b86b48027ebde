"""Saved plans: JSON with the Plan, the configuration it was searched for and its predicted figures.
A loaded plan is used without searching (and re-costed for the current shapes by the report)."""

from __future__ import annotations

import json
from pathlib import Path

from nnscaler.atomic_files import write_atomic
from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph
from nnscaler.policies.plan import Plan

__all__ = ["PLAN_FORMAT", "save_plan", "load_plan"]

PLAN_FORMAT = "nnscaler-autodist-plan/1"


def save_plan(plan: Plan, path: str | Path, predicted: dict | None = None) -> Path:
    """Write `plan` (and the predicted figures) to `path` as JSON; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"format": PLAN_FORMAT, "plan": json.loads(plan.to_json()), "predicted": predicted or {}}
    write_atomic(path, json.dumps(data, indent=1))
    return path


def load_plan(path: str | Path, graph: Graph | None = None, plan_ngpus: int | None = None) -> Plan:
    """Read a plan saved by save_plan (or a bare plan.json); check it names this graph's nodes."""
    path = Path(path)
    if not path.exists():
        raise PlanError(f"pas_config['load_plan_path'] = {str(path)!r}: no such file")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise PlanError(
            f"plan file {path} cannot be read ({err}); it is truncated or not a plan: save the plan again "
            "(pas_config['save_plan_path'] or python -m nnscaler.plan --save-plan), or drop load_plan_path"
        ) from err
    if "format" in data and data["format"] != PLAN_FORMAT:
        raise PlanError(f"{path} is a {data['format']!r} file; autodist reads {PLAN_FORMAT!r}")
    plan = Plan.from_json(json.dumps(data.get("plan", data)))
    if plan_ngpus is not None and plan.plan_ngpus != plan_ngpus:
        raise PlanError(
            f"plan {path} is for plan_ngpus={plan.plan_ngpus}, but ComputeConfig.plan_ngpus is {plan_ngpus}: "
            "search again (drop load_plan_path) or use the plan's device count"
        )
    if graph is not None:
        names = {n.name for n in graph.nodes}
        unknown = sorted(set(plan.nodes) - names)
        if unknown:
            raise PlanError(
                f"plan {path} names nodes this model's graph does not have ({unknown[:3]}...): it was saved for "
                "another model or another version of it; search again (drop load_plan_path)"
            )
    return plan
