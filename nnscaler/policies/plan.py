"""The Plan: frozen data saying how each node is split. Round-trips through JSON; never mutates a Graph."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

__all__ = ["NodePlan", "PipelinePlan", "ContextParallel", "Plan", "REPLICATE", "SCHEDULERS", "CP_KINDS"]


@dataclass(frozen=True)
class NodePlan:
    """Split one node `ways` ways on annotation identifier `split` (None: replicate on every device).

    blocks > 1: the identifier is cut into that many equal blocks, each split (fused q/k/v rows).
    note: why this choice was made (e.g. a fallback to replication), for people reading the plan.
    mesh_splits: a 2-D split over the plan's mesh (`Plan.mesh`): per mesh axis, the identifier split
      over that axis (None: replicated along it) and its blocks; `split`/`ways` are then unused.
    """

    split: str | None = None
    ways: int = 1
    blocks: int = 1
    note: str = ""
    mesh_splits: tuple[tuple[str | None, int], ...] = ()

    @property
    def is_split(self) -> bool:
        """Does any device compute a different part (a 1-D or a 2-D split)?"""
        if self.mesh_splits:
            return any(ident is not None for ident, _ in self.mesh_splits)
        return self.split is not None and self.ways > 1

    def describe(self) -> str:
        """For reports: 'h/4', 'h/4 x3 blocks', '(b, h)' or 'replicate'."""
        if self.mesh_splits:
            return "(" + ", ".join(ident or "R" for ident, _ in self.mesh_splits) + ")"
        if not self.is_split:
            return "replicate"
        return f"{self.split}/{self.ways}" + (f" x{self.blocks} blocks" if self.blocks > 1 else "")


REPLICATE = NodePlan()


SCHEDULERS = ("gpipe", "1f1b", "1f1b_interleaved", "zb_h1", "zbv", "dualpipev")
"""Pipeline schedules the runtime can run (see nnscaler.policies.schedules; the zero-bubble ones split
backwards into input and weight gradients: nnscaler.policies.zero_bubble)."""


@dataclass(frozen=True)
class PipelinePlan:
    """Pipeline stages over the plan devices.

    starts: the first node of every stage (stage 0 starts at the graph's first node); stages are
      consecutive runs of nodes.
    pp_size: device groups; stage s runs on group s % pp_size, i.e. plan devices
      [g * tp_size, (g + 1) * tp_size) with tp_size = plan_ngpus // pp_size. More stages than groups
      are virtual stages (1f1b_interleaved); zbv and dualpipev run 2 x pp_size stages in a V (stage s
      and stage 2 pp_size - 1 - s on group s: nnscaler.policies.pipeline_actions.stage_group).
    nmicros: micro-batches per train_step.
    """

    starts: tuple[str, ...]
    pp_size: int
    nmicros: int
    scheduler: str = "1f1b"
    pivots: tuple[str, ...] = ()
    """Module classes stages were allowed to start at (for people reading the plan)."""

    @property
    def nstages(self) -> int:
        return len(self.starts)

    def to_dict(self) -> dict:
        return {**asdict(self), "starts": list(self.starts), "pivots": list(self.pivots)}

    @classmethod
    def from_dict(cls, data: dict) -> PipelinePlan:
        return cls(
            tuple(data["starts"]), data["pp_size"], data["nmicros"], data["scheduler"], tuple(data["pivots"])
        )


CP_KINDS = ("zigzag", "ring", "ulysses", "hybrid")
"""How context-parallel attention passes the sequence (nnscaler.runtime.context_parallel): a ring of
key/value blocks balanced for causal masks (zigzag) or not (ring), all-to-all to heads (ulysses), or
Ulysses inside groups of `ulysses_size` devices with a ring across them (hybrid)."""


@dataclass(frozen=True)
class ContextParallel:
    """The sequence split over `size` devices of mesh axis `axis` (-1: all of a stage's devices)."""

    size: int
    kind: str = "zigzag"
    ulysses_size: int = 1
    axis: int = -1

    def describe(self) -> str:
        extra = (
            f", ulysses {self.ulysses_size} x ring {self.size // self.ulysses_size}"
            if self.kind == "hybrid"
            else ""
        )
        return f"context parallel {self.size} ({self.kind}{extra})"


@dataclass(frozen=True)
class Plan:
    """Per-node splits over the plan devices of one data-parallel replica."""

    policy: str
    plan_ngpus: int
    nodes: dict[str, NodePlan] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    recompute: tuple[str, ...] = ()
    """Module paths whose activations are recomputed in backward instead of kept (checkpointing)."""
    pipeline: PipelinePlan | None = None
    """Pipeline stages and schedule; None: one stage on all plan devices."""
    mesh: tuple[int, ...] = ()
    """The stage's devices as a mesh (row-major, e.g. (2, 2)) for nodes with `mesh_splits`; () for
    plans whose splits are all 1-D (each over all of the stage's devices)."""
    context_parallel: ContextParallel | None = None
    """The sequence split of attention (its kind and axis); None: no context parallelism."""

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The mesh layouts are laid over: `mesh`, or all of a stage's devices as one axis."""
        return self.mesh or (self.tp_size,)

    @property
    def tp_size(self) -> int:
        """Devices each stage is split over (all plan devices without a pipeline)."""
        return self.plan_ngpus // self.pipeline.pp_size if self.pipeline else self.plan_ngpus

    def node(self, name: str) -> NodePlan:
        return self.nodes.get(name, REPLICATE)

    def to_json(self) -> str:
        data = {
            "policy": self.policy,
            "plan_ngpus": self.plan_ngpus,
            "notes": list(self.notes),
            "recompute": list(self.recompute),
            "pipeline": self.pipeline.to_dict() if self.pipeline else None,
            **({"mesh": list(self.mesh)} if self.mesh else {}),
            **({"context_parallel": asdict(self.context_parallel)} if self.context_parallel else {}),
            "nodes": {
                k: {f: v for f, v in asdict(p).items() if v not in ("", None, ()) or f == "split"}
                for k, p in self.nodes.items()
            },
        }
        return json.dumps(data, indent=1, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        nodes = {}
        for k, v in data["nodes"].items():
            mesh_splits = tuple((ident, int(blocks)) for ident, blocks in v.get("mesh_splits", ()))
            nodes[k] = NodePlan(**{**v, "mesh_splits": mesh_splits})
        return cls(
            data["policy"],
            data["plan_ngpus"],
            nodes,
            tuple(data.get("notes", ())),
            tuple(data.get("recompute", ())),
            PipelinePlan.from_dict(data["pipeline"]) if data.get("pipeline") else None,
            tuple(data.get("mesh", ())),
            ContextParallel(**data["context_parallel"]) if data.get("context_parallel") else None,
        )

    def split_summary(self) -> dict[str, int]:
        """How many nodes are split vs replicated."""
        split = sum(1 for p in self.nodes.values() if p.is_split)
        return {"split": split, "replicated": len(self.nodes) - split}
