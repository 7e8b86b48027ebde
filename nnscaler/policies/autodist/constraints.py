"""Constraints on the search: which partitions an op may take, by op type and module path.

Entries follow nnScaler's partition-constraint YAML (a list of mappings):

    - name: linear                      # op: short name ('linear') or full ('aten.linear.default')
      parent_module: mlp                # module path suffix or class name ('' or absent: anywhere)
      allowed_partition_dims: ["0,0"]   # 'input index,dim' pairs; [] = never split
      replica_allowed: true             # replication allowed (default true)

Ours also accepts `allowed_splits: [n, k]`: annotation identifiers (e.g. never split the sequence:
allow only the heads of attention).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml

from nnscaler.errors import ConfigError
from nnscaler.graph.ir import Graph, Node
from nnscaler.policies.plan import NodePlan

__all__ = ["PartitionConstraint", "PartitionConstraints", "load_constraints"]


@dataclass(frozen=True)
class PartitionConstraint:
    """One rule: for ops called `name` under `parent_module`, only these partitions."""

    name: str
    parent_module: str = ""
    allowed_partition_dims: tuple[tuple[int, int], ...] | None = None
    """(input index, dim) pairs a split may cut; None: any; (): none."""
    allowed_splits: tuple[str, ...] | None = None
    """Annotation identifiers a split may use; None: any."""
    replica_allowed: bool = True

    def matches(self, graph: Graph, node: Node) -> bool:
        op = node.op
        short = op.split(".")[1] if op.startswith("aten.") and op.count(".") >= 2 else op
        if self.name not in (op, short, op.rsplit(".", 1)[0]):
            return False
        if not self.parent_module:
            return True
        path = node.module_path
        classes = {graph.module_classes.get(p, "") for p in _prefixes(path)}
        return (
            path == self.parent_module
            or path.endswith("." + self.parent_module)
            or (self.parent_module in classes)
            or any(p.endswith("." + self.parent_module) or p == self.parent_module for p in _prefixes(path))
        )


def _prefixes(path: str) -> list[str]:
    parts = path.split(".") if path else []
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


@dataclass(frozen=True)
class PartitionConstraints:
    rules: tuple[PartitionConstraint, ...] = field(default_factory=tuple)

    def allows(self, graph: Graph, node: Node, bound, plan: NodePlan) -> bool:
        """Every identifier the plan splits (both of a 2-D split) must be allowed by every matching rule."""
        if plan.mesh_splits:
            splits = [ident for ident, _ in plan.mesh_splits if ident is not None]
            return all(self.allows(graph, node, bound, NodePlan(ident, 2)) for ident in splits)
        for rule in self.rules:
            if not rule.matches(graph, node):
                continue
            if plan.split is None:
                if not rule.replica_allowed:
                    return False
                continue
            if rule.allowed_splits is not None and plan.split not in rule.allowed_splits:
                return False
            if rule.allowed_partition_dims is not None:
                idents = set()
                for i, d in rule.allowed_partition_dims:
                    if bound is not None and i < len(bound.anno.inputs):
                        dims = bound.anno.inputs[i].dims or ()
                        if d < len(dims) or -len(dims) <= d < 0:
                            idents.add(dims[d].ids[0])
                if plan.split not in idents:
                    return False
        return True

    def __bool__(self) -> bool:
        return bool(self.rules)


def _entry(data: object, index: int) -> PartitionConstraint:
    if not isinstance(data, dict) or "name" not in data:
        raise ConfigError(f"partition constraint #{index} must be a mapping with 'name', got {data!r}")
    known = {"name", "parent_module", "allowed_partition_dims", "allowed_splits", "replica_allowed"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"partition constraint #{index} ({data['name']!r}) has unknown keys {unknown}; known: {sorted(known)}"
        )
    dims = data.get("allowed_partition_dims")
    parsed = None
    if dims is not None:
        try:
            parsed = tuple(tuple(int(x) for x in str(d).split(",")) for d in dims)
        except ValueError as exc:
            raise ConfigError(
                f"partition constraint #{index}: allowed_partition_dims entries are 'input,dim' strings, got {dims!r}"
            ) from exc
        if any(len(p) != 2 for p in parsed):
            raise ConfigError(
                f"partition constraint #{index}: allowed_partition_dims entries need two ints: {dims!r}"
            )
    splits = data.get("allowed_splits")
    return PartitionConstraint(
        str(data["name"]),
        str(data.get("parent_module") or ""),
        parsed,
        tuple(str(s) for s in splits) if splits is not None else None,
        bool(data.get("replica_allowed", True)),
    )


def load_constraints(spec: str | Path | list | None) -> PartitionConstraints:
    """Constraints from a YAML file path, a list of mappings, or None."""
    if spec is None:
        return PartitionConstraints()
    if isinstance(spec, (str, Path)):
        path = Path(spec)
        if not path.exists():
            raise ConfigError(f"pas_config['partition_constraints_path'] = {str(spec)!r}: no such file")
        spec = yaml.safe_load(path.read_text()) or []
    if not isinstance(spec, list):
        raise ConfigError(f"partition constraints must be a list of mappings, got {type(spec).__name__}")
    return PartitionConstraints(tuple(_entry(d, i) for i, d in enumerate(spec)))
