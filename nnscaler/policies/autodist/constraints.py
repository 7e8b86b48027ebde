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

from dataclasses import dataclass, field, replace
from pathlib import Path

from nnscaler.errors import ConfigError, PlanError
from nnscaler.graph.ir import Graph, Node
from nnscaler.policies.autodist.yaml_files import read_yaml
from nnscaler.policies.plan import NodePlan

__all__ = [
    "PartitionConstraint",
    "PartitionConstraints",
    "load_constraints",
    "unsatisfiable_error",
    "describe_node",
]


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
    source: str = field(default="", compare=False)
    """Where the rule was given, e.g. "pas_config['partition_constraints'][0] = {...}" (for messages)."""

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


def _dim_idents(rule: PartitionConstraint, bound) -> set[str]:
    """The annotation identifiers of the (input, dim) pairs in rule.allowed_partition_dims."""
    idents = set()
    for i, d in rule.allowed_partition_dims or ():
        if bound is not None and i < len(bound.anno.inputs):
            dims = bound.anno.inputs[i].dims or ()
            if d < len(dims) or -len(dims) <= d < 0:
                idents.add(dims[d].ids[0])
    return idents


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
            if rule.allowed_partition_dims is not None and plan.split not in _dim_idents(rule, bound):
                return False
        return True

    def __bool__(self) -> bool:
        return bool(self.rules)


def describe_node(graph: Graph, node: Node) -> str:
    """'node linear_3 (aten.linear.default) in model.layers.0.mlp.up (Linear), at modeling.py:12  <code>'."""
    where = f"node {node.name} ({node.op})"
    if node.module_path:
        cls = node.module_class or graph.module_classes.get(node.module_path, "")
        where += f" in {node.module_path}" + (f" ({cls})" if cls else "")
    if node.source:
        loc, _, code = node.source.strip().partition("  ")
        where += f", at {loc}" + (f" `{code.strip()}`" if code.strip() else "")
    return where


def unsatisfiable_error(
    graph: Graph, node: Node, ways: int, constraints: PartitionConstraints, valid_splits: list[str], bound
) -> PlanError:
    """The PlanError for an op every partition of which the matching rules forbid (`valid_splits`: the
    splits its shapes allow over `ways` devices; `bound`: its bound annotation or None)."""
    rules = [r for r in constraints.rules if r.matches(graph, node)]
    named = "; ".join(r.source or repr(r) for r in rules) or "the partition constraints"
    shapes = (
        f"the splits its shapes allow over {ways} devices are {valid_splits}"
        if valid_splits
        else f"its shapes allow no split over {ways} device(s)"
    )
    sizes = getattr(bound, "sizes", None) or {}
    wanted = {i for r in rules for i in (r.allowed_splits or ())} | {
        i for r in rules for i in _dim_idents(r, bound)
    }
    uneven = [f"{i!r} has size {sizes[i]}" for i in sorted(wanted) if sizes.get(i) and sizes[i] % ways]
    if uneven:
        shapes += f"; {', '.join(uneven)}, which {ways} devices do not divide"
    return PlanError(
        f"autodist cannot honour {named} for {describe_node(graph, node)}: the rule forbids replication "
        f"and every split ({shapes}); allow one (allowed_partition_dims / allowed_splits), set "
        "replica_allowed: true, or narrow the rule with parent_module"
    )


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
    key = "pas_config['partition_constraints']"
    if isinstance(spec, (str, Path)):
        path = Path(spec)
        if not path.exists():
            raise ConfigError(f"pas_config['partition_constraints_path'] = {str(spec)!r}: no such file")
        key = f"pas_config['partition_constraints_path'] ({path})"
        spec = read_yaml(path, "partition constraints file") or []
    if not isinstance(spec, list):
        raise ConfigError(f"partition constraints must be a list of mappings, got {type(spec).__name__}")
    rules = (replace(_entry(d, i), source=f"{key}[{i}] = {d!r}") for i, d in enumerate(spec))
    return PartitionConstraints(tuple(rules))
