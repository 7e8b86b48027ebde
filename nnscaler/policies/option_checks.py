"""`pas_config` values that are well typed but cannot apply (issue 41: every setting applies or is refused).

options.py checks each key alone (its type, its range, unknown keys). `check_pas_config` runs when a
built-in policy plans (`make_plan`) and refuses a value the rest of the config, the devices or the model
leave unread: `cp_kind` without context parallelism, autodist's `tp_mesh` on a stage of another size,
pipeline keys of autodist without `use_end2end`. Each error is a
PasConfigError naming the key and the fix.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

from nnscaler.config import ComputeConfig
from nnscaler.graph.ir import Graph
from nnscaler.policies.options import (
    POLICY_OPTIONS,
    AutodistOptions,
    ContextParallelOptions,
    PasConfigError,
    PipelineOptions,
    parse_pas_config,
)

__all__ = ["check_pas_config", "check_options", "builtin_name"]


def builtin_name(fn: Callable) -> str | None:
    """The built-in policy name of policy function `fn`, or None for a custom policy."""
    from nnscaler.policies.registry import BUILTIN_POLICIES  # registry imports the policies

    return next((n for n, f in BUILTIN_POLICIES.items() if f is fn and n in POLICY_OPTIONS), None)


def check_pas_config(fn: Callable, cfg: ComputeConfig, graph: Graph | None = None) -> None:
    """Refuse a pas_config value of built-in policy `fn` that cannot apply to `cfg` (and `graph`)."""
    name = builtin_name(fn)
    if name is not None:
        check_options(name, cfg, graph)


def check_options(name: str, cfg: ComputeConfig, graph: Graph | None = None) -> None:
    """check_pas_config for the built-in policy called `name` (the offline planner calls it for autodist)."""
    raw = {k: v for k, v in cfg.pas_config.items() if isinstance(k, str) and not k.startswith("_")}
    opts = parse_pas_config(name, raw)
    if isinstance(opts, AutodistOptions):
        _check_autodist(opts, raw, cfg, graph)
        return
    if isinstance(opts, ContextParallelOptions):
        _check_cp(name, opts, raw)
    if isinstance(opts, PipelineOptions) and opts.pipeline_stages and "pipeline_pivots" in raw:
        raise _error(
            name,
            "pipeline_pivots",
            opts.pipeline_pivots,
            "pipeline_stages places every stage, so pivots are not read: drop one of the two",
        )


def _error(policy: str, key: str, value: Any, why: str) -> PasConfigError:
    return PasConfigError(f"pas_config[{key!r}]={value!r} cannot apply under policy {policy!r}: {why}")


def _check_cp(policy: str, opts: Any, raw: Mapping[str, Any]) -> None:
    """tp / hybrid: cp_kind and cp_ulysses_size need context parallelism (and 'hybrid' for the size)."""
    if opts.cp_size == 1 and "cp_kind" in raw:
        raise _error(
            policy, "cp_kind", opts.cp_kind, "it is read only with cp_size > 1; set cp_size or drop cp_kind"
        )
    if opts.cp_ulysses_size is not None and opts.cp_kind != "hybrid":
        raise _error(
            policy,
            "cp_ulysses_size",
            opts.cp_ulysses_size,
            f"it is read only with cp_kind 'hybrid' (cp_kind is {opts.cp_kind!r}); set cp_kind='hybrid' or drop it",
        )


_PIPELINE_KEYS = ("pipeline_scheduler", "pipeline_pivots")
"""autodist keys that only shape a pipeline: read only with use_end2end. (pipeline_nmicros and update_freq
are read without it too: the search costs a step of that many micro-batches, as gradient accumulation.)"""


def _check_autodist(
    opts: AutodistOptions, raw: Mapping[str, Any], cfg: ComputeConfig, graph: Graph | None
) -> None:
    if opts.load_plan_path:
        return  # a saved search replayed: the keys that produced it may stay (nnScaler 0.8's workflow)
    if opts.use_bf16 and opts.use_fp16:
        raise _error("autodist", "use_fp16", True, "use_bf16 is set too and wins: set only one of them")
    if opts.mem_constraint is not None and not opts.mem_constraint > 0:
        raise _error("autodist", "mem_constraint", opts.mem_constraint, "it is GB per device and must be > 0")
    if not opts.transient_mem_coef >= 0:
        raise _error("autodist", "transient_mem_coef", opts.transient_mem_coef, "it must be >= 0")
    if opts.solver == "highs":
        from nnscaler.policies.autodist.spmd import available_solvers

        if "highs" not in available_solvers():
            raise _error(
                "autodist", "solver", "highs", "HiGHS is not installed: `pip install highspy` or use 'cbc'"
            )
    if "update_freq" in raw and "pipeline_nmicros" in raw:
        raise _error(
            "autodist", "update_freq", raw["update_freq"], "pipeline_nmicros is given and wins: give only one"
        )
    if not cfg.use_end2end:
        for key in _PIPELINE_KEYS:
            if key in raw and raw[key] != _default(key):
                raise _error(
                    "autodist",
                    key,
                    raw[key],
                    "autodist plans pipelines only for end-to-end training steps: set "
                    "ComputeConfig(use_end2end=True) or drop it",
                )
    elif opts.pipeline_nstages == 1 and "pipeline_scheduler" in raw:
        raise _error(
            "autodist", "pipeline_scheduler", opts.pipeline_scheduler, "pipeline_nstages is 1: no pipeline"
        )
    if opts.cp_size == 1 and "cp_kind" in raw:
        raise _error(
            "autodist", "cp_kind", opts.cp_kind, "cp_size is 1 (no context parallelism): drop cp_kind"
        )
    if opts.cp_ulysses_size is not None and (opts.cp_size == 1 or opts.cp_kind not in ("hybrid", "auto")):
        raise _error(
            "autodist",
            "cp_ulysses_size",
            opts.cp_ulysses_size,
            "it is read only for cp_kind 'hybrid' (or 'auto') with cp_size > 1",
        )
    _check_tp_mesh(opts, cfg)
    if graph is not None:
        _check_constraints(opts, graph)


def _default(key: str) -> Any:
    return next(f.default for f in fields(AutodistOptions) if f.name == key)


def _check_tp_mesh(opts: AutodistOptions, cfg: ComputeConfig) -> None:
    """A pinned mesh must be the devices of a stage: plan_ngpus / (stages x cp x ep) of the devices.
    With a pinned mesh the cp and ep searches stay at 1 unless pinned (cp_search, ep_search)."""
    mesh = opts.tp_mesh
    if not isinstance(mesh, list) or len(mesh) not in (2, 3) or min(mesh) < 2:
        return  # 'auto' / 'off', or a shape autodist itself refuses naming tp_mesh
    size, n = math.prod(mesh), cfg.plan_ngpus
    others = (opts.cp_size if isinstance(opts.cp_size, int) else 1) * (
        opts.ep_size if isinstance(opts.ep_size, int) else 1
    )
    staged = isinstance(opts.pipeline_nstages, int) or not cfg.use_end2end
    stages = opts.pipeline_nstages if isinstance(opts.pipeline_nstages, int) else 1
    if n % (size * others):
        room = n // others if n % others == 0 else 0
        other = f"a mesh of {room} devices, " if room >= 4 else ""
        fix = f"use {other}'off' (1-D splits), or plan_ngpus a multiple of {size * others}"
    elif staged and n != size * others * stages:
        fix = (
            f"a stage has plan_ngpus / (pipeline_nstages x cp_size x ep_size) = {n // (others * stages)} devices; "
            f"pin a mesh of that size or pipeline_nstages={n // (size * others)}"
        )
    else:
        return
    raise _error(
        "autodist", "tp_mesh", mesh, f"the mesh needs {size} devices per stage (plan_ngpus={n}): {fix}"
    )


def _check_constraints(opts: AutodistOptions, graph: Graph) -> None:
    """Every inline partition constraint must match an op of the model (else it constrains nothing)."""
    from nnscaler.policies.autodist.constraints import load_constraints

    given = [opts.partition_constraints, opts.partition_constraints_path]
    rules = [r for g in given if g for r in load_constraints(g).rules]
    for rule in rules:
        if not any(rule.matches(graph, node) for node in graph.nodes):
            raise PasConfigError(
                f"{rule.source or 'pas_config[partition_constraints]'} matches no op of the model (op name "
                f"{rule.name!r} under {rule.parent_module or 'any module'!r}): fix the op or module name or drop it"
            )
