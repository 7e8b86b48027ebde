"""The Plan: frozen data saying how each node is split. Round-trips through JSON; never mutates a Graph."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

__all__ = ["NodePlan", "Plan", "REPLICATE"]


@dataclass(frozen=True)
class NodePlan:
    """Split one node `ways` ways on annotation identifier `split` (None: replicate on every device).

    blocks > 1: the identifier is cut into that many equal blocks, each split (fused q/k/v rows).
    note: why this choice was made (e.g. a fallback to replication), for people reading the plan.
    """

    split: str | None = None
    ways: int = 1
    blocks: int = 1
    note: str = ""


REPLICATE = NodePlan()


@dataclass(frozen=True)
class Plan:
    """Per-node splits over the plan devices of one data-parallel replica."""

    policy: str
    plan_ngpus: int
    nodes: dict[str, NodePlan] = field(default_factory=dict)
    notes: tuple[str, ...] = ()
    recompute: tuple[str, ...] = ()
    """Module paths whose activations are recomputed in backward instead of kept (checkpointing)."""

    def node(self, name: str) -> NodePlan:
        return self.nodes.get(name, REPLICATE)

    def to_json(self) -> str:
        data = {
            "policy": self.policy,
            "plan_ngpus": self.plan_ngpus,
            "notes": list(self.notes),
            "recompute": list(self.recompute),
            "nodes": {
                k: {f: v for f, v in asdict(p).items() if v not in ("", None) or f == "split"}
                for k, p in self.nodes.items()
            },
        }
        return json.dumps(data, indent=1, sort_keys=False)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = json.loads(text)
        nodes = {k: NodePlan(**v) for k, v in data["nodes"].items()}
        return cls(
            data["policy"],
            data["plan_ngpus"],
            nodes,
            tuple(data.get("notes", ())),
            tuple(data.get("recompute", ())),
        )

    def split_summary(self) -> dict[str, int]:
        """How many nodes are split vs replicated."""
        split = sum(1 for p in self.nodes.values() if p.split is not None and p.ways > 1)
        return {"split": split, "replicated": len(self.nodes) - split}
