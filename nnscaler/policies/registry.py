"""The built-in policies by name, how a `pas_policy` (a name, a dotted path or a callable) resolves to a
function, and the validation of a built-in policy's `pas_config` against its typed options."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

from nnscaler.config import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph
from nnscaler.policies.builtin import pas_autodist, pas_data, pas_dp
from nnscaler.policies.options import POLICY_OPTIONS, PolicyOptions, parse_pas_config
from nnscaler.policies.pipeline import pas_hybrid, pas_pp
from nnscaler.policies.plan import Plan
from nnscaler.policies.tp import pas_tp

__all__ = ["Policy", "BUILTIN_POLICIES", "resolve_policy", "validate_pas_config"]

Policy = Callable[[Graph, ComputeConfig], Plan]

BUILTIN_POLICIES: dict[str, Policy] = {
    "dp": pas_dp,
    "data": pas_data,
    "tp": pas_tp,
    "pp": pas_pp,
    "hybrid": pas_hybrid,
    "autodist": pas_autodist,
}


def resolve_policy(policy: str | Policy) -> tuple[str, Policy]:
    """A built-in name, a dotted path 'package.module.function', or a callable: ours returning a Plan, or
    nnScaler 0.8's IRGraph policy (make_plan tells them apart: nnscaler.policies.policy_api08)."""
    if callable(policy):
        return getattr(policy, "__name__", "custom"), policy
    if policy in BUILTIN_POLICIES:
        return policy, BUILTIN_POLICIES[policy]
    if isinstance(policy, str) and "." in policy:
        module, _, name = policy.rpartition(".")
        return policy, getattr(importlib.import_module(module), name)
    raise PlanError(f"unknown pas_policy {policy!r}: use one of {sorted(BUILTIN_POLICIES)} or a callable")


def validate_pas_config(policy: str | Callable, pas_config: Mapping[str, Any] | None) -> PolicyOptions | None:
    """Validate `pas_config` for a built-in policy (by name, dotted path or the function itself);
    None (nothing checked) for a custom policy."""
    _, fn = resolve_policy(policy)
    name = next((n for n, f in BUILTIN_POLICIES.items() if f is fn and n in POLICY_OPTIONS), None)
    return None if name is None else parse_pas_config(name, pas_config)
