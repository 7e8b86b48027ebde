"""What stays whole: the share of parameters and of FLOPs each rank holds or computes whole (replicated
over the tensor-parallel devices of its stage) under a plan over several devices, and the causes, grouped
(see nnscaler.parallel.whole_reasons). The compile log and plan_report.md print it; CompileResult has it.

Parameters are counted in bytes as the partitioned program stores them (a weight is whole when its layout
is Replicate); FLOPs are forward FLOPs of autodist's analytic cost model, an op being whole when the plan
does not split it. Shares are of the whole model's (the stages' together); each stage has its own too.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass

import torch

from nnscaler.graph.ir import Graph, Replicate
from nnscaler.parallel.whole_reasons import Why, node_causes, op_flops, param_cause
from nnscaler.policies.autodist.cost import local_bytes
from nnscaler.policies.pipeline_actions import stage_group

__all__ = ["WholeReason", "StageShare", "ReplicatedShare", "replicated_share"]


@dataclass(frozen=True)
class WholeReason:
    """One cause and what it keeps whole."""

    kind: str
    """'pipeline-only', 'opaque', 'unannotated', 'indivisible', 'policy', 'planner-small',
    'planner-cheaper', 'data-parallel', 'sliced', 'bias', 'unused' or 'follows' (no named cause)."""
    text: str
    param_share: float
    """Share of the model's parameter bytes it keeps whole."""
    flops_share: float
    """Share of the model's forward FLOPs it keeps whole."""
    ops: int
    params: int
    example: str
    """The first op (op at line (module)) or weight it covers."""
    named: bool
    """Does it say why (everything but 'follows')?"""
    saved_ms: float = 0.0
    comm_ms: float = 0.0

    def describe(self) -> str:
        extra = ""
        if self.kind.startswith("planner"):
            extra = (
                f" (splitting would save {self.saved_ms:.4f} ms of compute per micro-batch; regathering "
                f"the outputs costs {self.comm_ms:.4f} ms)"
            )
        counts = f"{self.ops} op(s), {self.params} weight(s); e.g. {self.example}"
        return f"{self.param_share:.1%} params, {self.flops_share:.1%} FLOPs: {self.text}{extra} [{counts}]"


@dataclass(frozen=True)
class StageShare:
    stage: int
    devices: tuple[int, ...]
    """Plan devices of the stage's group (every one holds the same)."""
    param_share: float
    """Share of the stage's parameter bytes each of its devices holds whole."""
    flops_share: float
    held_share: float = 1.0
    """The stage's parameter bytes as a share of the model's."""
    local_share: float = 1.0
    """What one device of the stage holds (whole weights and its pieces of split ones), as a share of the
    model's parameter bytes (a split weight counted at the piece one device holds)."""


@dataclass(frozen=True)
class ReplicatedShare:
    """What stays whole under a plan over several devices."""

    policy: str
    tp_size: int
    param_share: float
    """Share of the model's parameter bytes held whole on their stage's devices."""
    flops_share: float
    """Share of the model's forward FLOPs computed whole on their stage's devices."""
    param_bytes: int
    flops: float
    stages: tuple[StageShare, ...]
    reasons: tuple[WholeReason, ...]
    """Every cause, largest first (parameter share + FLOPs share)."""

    def top(self, n: int = 5) -> tuple[WholeReason, ...]:
        return self.reasons[:n]

    @property
    def local_share(self) -> float:
        """The most of the model's parameter bytes one device holds (its fullest stage's)."""
        return max((s.local_share for s in self.stages), default=1.0)

    def headline(self) -> str:
        if self.tp_size == 1:
            return (
                f"policy {self.policy!r}, one device per stage (pipeline-only): nothing is split within a "
                f"stage; each rank holds its stage's parameters whole, at most {self.local_share:.1%} of the "
                "model's"
            )
        return (
            f"policy {self.policy!r}, {self.tp_size} device(s) per stage: each rank holds "
            f"{self.param_share:.1%} of the parameters and computes {self.flops_share:.1%} of the FLOPs "
            f"whole (replicated over its stage's devices); a rank holds at most {self.local_share:.1%} of the "
            "parameters in all"
        )

    def summary(self, top: int = 5) -> str:
        """For the compile log: the headline, per-stage shares (pipelines), the top causes."""
        lines = ["what stays whole: " + self.headline()]
        if len(self.stages) > 1:
            lines += [
                f"  stage {s.stage} (devices {','.join(map(str, s.devices))}): {s.held_share:.1%} of the "
                f"parameters; {s.param_share:.1%} of them and {s.flops_share:.1%} of its FLOPs whole"
                for s in self.stages
            ]
        if self.reasons:
            lines.append("  top reasons:")
            lines += [f"    {r.describe()}" for r in self.top(top)]
        return "\n".join(lines)

    def markdown(self, top: int = 8) -> list[str]:
        """The plan report's section."""
        lines = ["", "## What stays whole", "", self.headline() + "."]
        if len(self.stages) > 1:
            lines += [
                "",
                "| stage | devices | its share of the parameters | held whole | FLOPs whole |",
                "|---|---|---|---|---|",
            ]
            lines += [
                f"| {s.stage} | {','.join(map(str, s.devices))} | {s.held_share:.1%} | {s.param_share:.1%} | "
                f"{s.flops_share:.1%} |"
                for s in self.stages
            ]
        if self.reasons:
            lines += ["", "| params | FLOPs | why | ops | weights | e.g. |", "|---|---|---|---|---|---|"]
            for r in self.top(top):
                why = r.describe().split(": ", 1)[1].rsplit(" [", 1)[0].replace("|", "\\|")
                lines.append(
                    f"| {r.param_share:.1%} | {r.flops_share:.1%} | {why} | {r.ops} | {r.params} | "
                    f"{r.example.replace('|', '/')} |"
                )
        return lines

    def to_dict(self) -> dict:
        return {**asdict(self), "local_share": self.local_share}


def _stage_of(graph: Graph, plan) -> dict[str, int]:
    starts = set(plan.pipeline.starts) if plan.pipeline else set()
    stage, out = (-1 if starts else 0), {}
    for n in graph.nodes:
        if n.name in starts:
            stage += 1
        out[n.name] = max(stage, 0)
    return out


def _nbytes(t) -> int:
    n = 1
    for s in t.full_shape:
        n *= s
    return n * getattr(torch, t.dtype).itemsize


def _where(node) -> str:
    line = node.source.split("  ", 1)[0] if node.source else "unknown source"
    return f"{node.op} at {line}" + (f" ({node.module_path})" if node.module_path else "")


def replicated_share(graph: Graph, plan, program, cfg=None) -> ReplicatedShare:
    """The shares and causes for `plan` partitioned into `program` (a Program or a PipelineProgram)."""
    tp = plan.tp_size
    stage_of = _stage_of(graph, plan)
    inherited: set[str] = set()
    causes = node_causes(graph, plan, {n: tp for n in stage_of}, cfg, inherited)
    groups: dict[Why, dict] = {}

    def add(why: Why, example: str, params=0, nbytes=0, ops=0, flops=0.0, own=True):
        g = groups.setdefault(
            why, {"bytes": 0, "flops": 0.0, "ops": 0, "params": 0, "ex": example, "size": -math.inf}
        )
        # the costliest op whose own cause it is names the group, else the costliest op, else the largest weight
        size = (flops if own else flops - 1e20) if ops else float(nbytes) - 1e30
        if size > g["size"]:
            g["ex"], g["size"] = example, size
        g["bytes"] += nbytes
        g["flops"] += flops
        g["ops"] += ops
        g["params"] += params
        g["saved"] = g.get("saved", 0.0) + (why.saved_s if ops else 0.0)
        g["comm"] = g.get("comm", 0.0) + (why.comm_s if ops else 0.0)

    flops_total: dict[int, float] = defaultdict(float)
    flops_whole: dict[int, float] = defaultdict(float)
    for node in graph.nodes:
        f = op_flops(node, graph)
        s = stage_of[node.name]
        flops_total[s] += f
        if node.name in causes:
            flops_whole[s] += f
            add(causes[node.name], _where(node), ops=1, flops=f, own=node.name not in inherited)
    held_total: dict[int, int] = defaultdict(int)
    held_whole: dict[int, int] = defaultdict(int)
    held_local: dict[int, float] = defaultdict(float)
    consumers = graph.consumers()
    stages = [(s.index, s.program) for s in program.stages] if hasattr(program, "stages") else [(0, program)]
    for index, prog in stages:
        for t in prog.tensors:
            if not t.is_param:
                continue
            nb = _nbytes(t)
            held_total[index] += nb
            held_local[index] += local_bytes(nb, t.layout, tp, prog.mesh) if tp > 1 else nb
            if tp == 1 or isinstance(t.layout, Replicate):
                held_whole[index] += nb
                add(param_cause(graph, plan, consumers, t.name, causes), t.original_name, params=1, nbytes=nb)
    pbytes, fsum = sum(held_total.values()), sum(flops_total.values())
    reasons = _reasons(groups, pbytes, fsum)
    pp = plan.pipeline.pp_size if plan.pipeline else 1
    scheduler = plan.pipeline.scheduler if plan.pipeline else "1f1b"
    nstages = max(stage_of.values(), default=0) + 1
    per_stage = tuple(
        StageShare(
            s,
            tuple(range(stage_group(scheduler, s, pp) * tp, stage_group(scheduler, s, pp) * tp + tp)),
            held_whole[s] / (held_total[s] or 1),
            flops_whole[s] / (flops_total[s] or 1),
            held_total[s] / (pbytes or 1),
            held_local[s] / (pbytes or 1),
        )
        for s in range(nstages)
    )
    return ReplicatedShare(
        plan.policy,
        tp,
        sum(held_whole.values()) / (pbytes or 1),
        sum(flops_whole.values()) / (fsum or 1),
        pbytes,
        fsum,
        per_stage,
        tuple(reasons),
    )


def _reasons(groups: dict[Why, dict], pbytes: int, fsum: float) -> list[WholeReason]:
    """One WholeReason per cause, the largest share of parameters and FLOPs first."""
    reasons = [
        WholeReason(
            w.kind,
            w.text,
            g["bytes"] / (pbytes or 1),
            g["flops"] / (fsum or 1),
            g["ops"],
            g["params"],
            g["ex"],
            w.named,
            g["saved"] * 1e3,
            g["comm"] * 1e3,
        )  # fmt: skip
        for w, g in groups.items()
    ]
    reasons.sort(key=lambda r: (-(r.param_share + r.flops_share), r.text))
    return reasons
