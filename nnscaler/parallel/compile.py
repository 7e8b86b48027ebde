"""Compile a module: capture -> plan -> partition -> codegen, writing the output directory."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nnscaler.codegen import generate_code, write_atomic
from nnscaler.config import ComputeConfig
from nnscaler.errors import ConfigError
from nnscaler.graph.capture import capture
from nnscaler.graph.ir import Graph, graph_from_json, graph_to_json
from nnscaler.parallel.artifacts import torch_bytes
from nnscaler.parallel.replicated import ReplicatedShare, replicated_share
from nnscaler.parallel.resolved_policy import ResolvedPolicy, resolve_pas_policy
from nnscaler.parallel.savedir import CONSTANTS_FILE
from nnscaler.parallel.unannotated import check_unannotated
from nnscaler.parallel.unsplit import UnsplitWeight, unsplit_summary, unsplit_weights
from nnscaler.partition.apply_plan import apply_plan
from nnscaler.partition.pipeline import apply_pipeline
from nnscaler.policies import make_plan
from nnscaler.runtime.module_parts.compiled import compile_options

__all__ = ["CompileResult", "compile_module", "CONSTANTS_FILE"]


@dataclass
class CompileResult:
    outdir: Path
    graph: Graph
    seconds: dict[str, float] = field(default_factory=dict)
    unsplit: list[UnsplitWeight] = field(default_factory=list)
    """The largest weights kept whole on every device of a tensor-parallel group, with the reason."""
    replicated: ReplicatedShare | None = None
    """Under a plan over several devices (plan_ngpus > 1): the share of parameters and FLOPs each rank
    holds / computes whole (replicated over its stage's devices), with the causes grouped; else None."""


_log = logging.getLogger(__name__)


def _save_constants(outdir: Path, graph: Graph) -> None:
    """Tensors the forward creates from literals go to constants.pt (atomically); gencode loads them."""
    path = outdir / CONSTANTS_FILE
    if not graph.constants:
        path.unlink(missing_ok=True)
        return
    write_atomic(path, torch_bytes(dict(graph.constants)))


def plan_fingerprint(graph_json: bytes, plan_json: str, cfg: ComputeConfig) -> str:
    """A hash of what decides which pieces each rank holds (traced graph, plan, device counts): names
    the plan in checkpoints. Settings that keep the layout (reducer, ZeRO, ...) leave it unchanged."""
    devices = f"{cfg.plan_ngpus}/{cfg.runtime_ngpus}".encode()
    return hashlib.sha256(graph_json + plan_json.encode() + devices).hexdigest()[:32]


def _folds_weight_grads(cfg: ComputeConfig) -> bool:
    """Whether weights replicated where their readers split the batch are summed by the reducer (in its
    buckets, over the plan axis x the replicas; ZeRO 1 / 2 shards them over that group) instead of a
    `copy_to_group` each. Not under ZeRO 3, zero_ngroups > 1 or robust aggregation, nor without replicas."""
    zero = cfg.use_zero and (getattr(cfg, "zero_stage", 1) == 3 or cfg.zero_ngroups > 1)
    plain = not (zero or cfg.inference_only) and cfg.grad_aggregation == "mean"
    return plain and cfg.runtime_ngpus > cfg.plan_ngpus


def compile_module(
    module: torch.nn.Module,
    dummy_forward_args: dict,
    policy: str | Callable | ResolvedPolicy,
    cfg: ComputeConfig,
    outdir: Path,
    version: str,
    reuse_graph: bool = False,
    graph: Graph | None = None,
) -> CompileResult:
    """Write graph.json, plan.json, compute_config.json and gencode{rank}.py for every runtime rank.

    `graph`: a graph already traced (or loaded) for this module; `reuse_graph`: load graph.json from
    `outdir` when it exists (unchecked: `parallelize(reuse='graph')` checks it against the model).
    Either way the module is not traced again. `policy` as parallelize resolved it; a name or callable
    is resolved here, and cfg.pas_config validated for it before tracing (a misspelled key fails fast).
    """
    policy = resolve_pas_policy(policy, cfg.pas_config)
    outdir.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    graph_file = outdir / "graph.json"
    graph = _graph_for(module, dummy_forward_args, policy, cfg, graph_file, reuse_graph, graph)
    check_unannotated(graph)
    seconds["capture"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    plan = make_plan(graph, policy.fn, cfg)
    if plan.pipeline and cfg.grad_aggregation != "mean":
        raise ConfigError(
            f"ComputeConfig.grad_aggregation={cfg.grad_aggregation!r} is not supported with pipeline stages yet "
            f"(policy {policy.name!r} planned {plan.pipeline.nstages}): use grad_aggregation='mean' or no pipeline"
        )
    write_atomic(outdir / "plan.json", plan.to_json())
    seconds["plan"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    partition = apply_pipeline if plan.pipeline else apply_plan
    try:
        program = partition(graph, plan, fold_weight_grads=_folds_weight_grads(cfg))
    except Exception:
        _write_plan_report(outdir, graph, plan, cfg, None)  # what was chosen, to debug the failure
        raise
    seconds["partition"] = time.perf_counter() - t0
    unsplit = _unsplit(graph, plan, program)
    whole = replicated_share(graph, plan, program, cfg) if cfg.plan_ngpus > 1 else None
    _write_plan_report(outdir, graph, plan, cfg, whole)
    t0 = time.perf_counter()
    full_shapes = {k: v.meta.shape for k, v in graph.values.items() if v.meta is not None}
    plan_id = plan_fingerprint(graph_file.read_bytes(), plan.to_json(), cfg)
    for rank in range(cfg.runtime_ngpus):
        src = generate_code(
            program, rank, cfg, graph.module_class, policy.name, full_shapes, version, plan_id
        )
        write_atomic(outdir / f"gencode{rank}.py", src)
    write_atomic(outdir / "compute_config.json", json.dumps(cfg.to_dict(), indent=2, default=str))
    seconds["codegen"] = time.perf_counter() - t0
    _log.info(
        "compiled %s: %s; capture %.2fs, plan %.2fs, partition %.2fs, codegen %.2fs",
        graph.module_class,
        _plan_summary(plan, cfg),
        *(seconds[k] for k in ("capture", "plan", "partition", "codegen")),
    )
    if whole is not None:
        _log.info("%s", whole.summary())
    if plan.tp_size > 1:
        _log.info("%s", unsplit_summary(unsplit))
    _log.info("generated code: %s", outdir / f"gencode{{0..{cfg.runtime_ngpus - 1}}}.py")
    return CompileResult(outdir, graph, seconds, unsplit, whole)


def _graph_for(
    module: torch.nn.Module,
    dummy_forward_args: dict,
    policy: ResolvedPolicy,
    cfg: ComputeConfig,
    graph_file: Path,
    reuse_graph: bool,
    graph: Graph | None,
) -> Graph:
    """The graph given, the one saved in `graph_file` (reuse_graph), or a new trace (then saved)."""
    if graph is not None:
        if not graph_file.exists():
            write_atomic(graph_file, graph_to_json(graph))
        return graph
    if reuse_graph and graph_file.exists():
        return graph_from_json(graph_file.read_text())
    graph = capture(
        module,
        dummy_forward_args,
        constant_folding=cfg.constant_folding,  # sizes the code computes with become constants
        leaf_modules=list(policy.leaf_modules),  # submodules run eagerly as one op
        auto_leaf_modules=policy.auto_leaf_modules,
        trace_time_budget_s=cfg.trace_time_budget_s,  # past it: sizes fixed, with a warning
        # compiled, forward's Python side effects (`self.calls += 1`) are refused, not just warned about
        refuse_side_effects="ComputeConfig.torch_compile" if compile_options(cfg.torch_compile) else None,
    )
    write_atomic(graph_file, graph_to_json(graph))
    _save_constants(graph_file.parent, graph)
    return graph


def _write_plan_report(
    outdir: Path, graph: Graph, plan: Any, cfg: ComputeConfig, whole: ReplicatedShare | None
):
    """autodist's plan_report.md (what it chose and why) beside the generated code, with what stays whole."""
    if plan.policy != "autodist":
        return
    from nnscaler.policies.autodist.report import plan_report_text

    section = whole.markdown() if whole is not None else []
    write_atomic(outdir / "plan_report.md", plan_report_text(graph, plan, cfg, section))


def _unsplit(graph: Graph, plan: Any, program: Any) -> list[UnsplitWeight]:
    """The largest weights the plan keeps whole on every device of a tensor-parallel group."""
    if plan.tp_size == 1:
        return []
    stages = [s.program for s in program.stages] if hasattr(program, "stages") else [program]
    tensors = list({t.name: t for p in reversed(stages) for t in p.tensors}.values())
    return unsplit_weights(graph, plan, tensors)


def _plan_summary(plan: Any, cfg: ComputeConfig) -> str:
    stages = f", {plan.pipeline.nstages} pipeline stages" if getattr(plan, "pipeline", None) else ""
    return (
        f"policy {plan.policy!r} over plan_ngpus={cfg.plan_ngpus}{stages}, "
        f"{cfg.runtime_ngpus // cfg.plan_ngpus} data-parallel replica(s)"
    )
