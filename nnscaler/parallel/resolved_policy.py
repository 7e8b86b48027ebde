"""`pas_policy` and its `pas_config`, resolved and validated once per parallelize call.

parallelize resolves the policy (a built-in name, a dotted path or a callable) to its function and
validates `ComputeConfig.pas_config` on every rank before tracing; the fingerprint and the compile
read the result instead of resolving and parsing again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nnscaler.errors import PlanError
from nnscaler.policies.options import PolicyOptions, leaf_module_options
from nnscaler.policies.registry import BUILTIN_POLICIES, resolve_policy, validate_pas_config

__all__ = ["ResolvedPolicy", "resolve_pas_policy"]


@dataclass(frozen=True)
class ResolvedPolicy:
    """A policy function with what the compile stages read off its `pas_config`."""

    name: str
    """What logs and generated code call it: the built-in name, the dotted path, or the function's name."""
    fn: Callable
    """`(graph, compute_config) -> Plan`, or nnScaler 0.8's `(graph: IRGraph, cfg) -> IRGraph` (make_plan
    runs it on an IRGraph front and converts what it recorded: nnscaler.policies.policy_api08)."""
    builtin: bool
    """A shipped policy: its code is covered by the nnscaler version (a custom one's source is fingerprinted)."""
    options: PolicyOptions | None
    """The typed pas_config of a built-in policy; None for a custom one (it reads pas_config itself)."""
    leaf_modules: tuple[str, ...]
    """pas_config['leaf_modules'] as names: submodules capture keeps as one opaque op each."""
    auto_leaf_modules: bool
    """pas_config['auto_leaf_modules']: make a failing data-dependent submodule a leaf and retry."""


def resolve_pas_policy(
    policy: str | Callable | ResolvedPolicy, pas_config: Mapping[str, Any] | None
) -> ResolvedPolicy:
    """Resolve `policy` and validate `pas_config` for it (PasConfigError naming a bad key or value);
    a ResolvedPolicy is returned as it is."""
    if isinstance(policy, ResolvedPolicy):
        return policy
    name, fn = resolve_policy(policy)
    if not callable(fn):
        raise PlanError(f"pas_policy {policy!r} names a {type(fn).__name__}, not a policy function")
    options = validate_pas_config(fn, pas_config)
    leaves, auto_leaves = leaf_module_options(pas_config)
    builtin = any(fn is f for f in BUILTIN_POLICIES.values())
    return ResolvedPolicy(name, fn, builtin, options, tuple(leaves), auto_leaves)
