"""The Trainer's console milestones, printed on rank 0 only: where the generated code is, a one-line
plan summary, each validation loss, the resume point and every checkpoint saved.

Lines start with `nnscaler-train:` and go to stdout (flushed), next to the step lines of `Progress`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from nnscaler.runtime import ParallelModule

__all__ = ["say", "generated_dirs", "plan_summary", "announce_model"]

PREFIX = "nnscaler-train:"


def say(rank: int, message: str) -> None:
    """Print `message` on rank 0 (other ranks stay quiet)."""
    if rank == 0:
        print(f"{PREFIX} {message}", file=sys.stdout, flush=True)


def generated_dirs(model: torch.nn.Module) -> list[Path]:
    """The directories holding the generated code of every ParallelModule in `model`."""
    out = []
    for m in model.modules():
        if isinstance(m, ParallelModule):
            file = getattr(sys.modules.get(type(m).__module__), "__file__", None)
            if file and Path(file).parent not in out:
                out.append(Path(file).parent)
    return out


def _plan(directory: Path) -> dict[str, Any]:
    try:
        return json.loads((directory / "plan.json").read_text())
    except (OSError, ValueError):
        return {}


def plan_summary(args: Any, model: torch.nn.Module, full_numel: int) -> str:
    """One line: the policy, ranks per replica x replicas, pipeline, ZeRO, and this rank's parameters."""
    cc = args.compute_config
    dirs = generated_dirs(model)
    plan = _plan(dirs[0]) if dirs else {}
    policy = plan.get("policy") or args.pas_policy
    pipe = plan.get("pipeline")
    stages = (
        f"{len(pipe['starts'])} pipeline stages ({pipe['scheduler']}, {pipe['nmicros']} micro-batches)"
        if pipe
        else "no pipeline"
    )
    replicas = cc.runtime_ngpus // cc.plan_ngpus
    zero = f"ZeRO stage {cc.zero_stage}" if cc.use_zero else "ZeRO off"
    local = sum(p.numel() for p in model.parameters())
    return (
        f"plan: {policy} over {cc.plan_ngpus} rank(s) x {replicas} data-parallel replica(s), {stages}, "
        f"{zero}; rank 0 holds {local:,} of {full_numel:,} parameter values"
    )


def announce_model(rank: int, args: Any, model: torch.nn.Module, full_numel: int) -> None:
    """On rank 0: where each ParallelModule's generated code is, then the plan summary."""
    if rank != 0:
        return
    for where in generated_dirs(model):
        say(rank, f"generated code: {where}")
    say(rank, plan_summary(args, model, full_numel))
