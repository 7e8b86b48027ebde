"""The per-rank program partition produces: SPMD statements with rank-dependent constants left symbolic."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nnscaler.graph.ir import Layout, ShapeRule, TensorMeta

__all__ = ["RankScaled", "Statement", "LocalTensor", "Program"]


@dataclass(frozen=True)
class RankScaled:
    """A constant that depends on the rank: (index of the rank in its tensor-parallel group) * scale, or
    with `axis` set, (the rank's coordinate on that mesh axis) * scale."""

    scale: int
    axis: int | None = None


@dataclass
class Statement:
    """One line of generated forward code.

    kind: 'op' (an aten op on local tensors), 'comm' (a nnscaler.runtime.comm call), 'special' (a
    runtime helper standing in for a split op), 'scale' (divide by a constant), 'bias' (add a bias).
    """

    kind: str
    op: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[str]
    node: str | None = None
    source: str = ""
    module_path: str = ""
    module_class: str = ""
    note: str = ""
    no_grad: bool = False
    tuple_output: bool = False
    shard_rng: bool = False
    """Run under this rank's shard generator (random ops on a sharded activation, e.g. attention dropout)."""


@dataclass
class LocalTensor:
    """A parameter or buffer as this rank holds it."""

    name: str
    original_name: str
    aliases: tuple[str, ...]
    full_shape: tuple[int, ...]
    dtype: str
    layout: Layout
    is_param: bool
    persistent: bool = True


@dataclass
class Program:
    """What every rank of one tensor-parallel group runs (identical but for RankScaled constants)."""

    ways: int
    mesh: tuple[int, ...] = ()
    """The devices of the group as a mesh (row-major) when some node is split 2-D; () otherwise."""
    tensors: list[LocalTensor] = field(default_factory=list)
    statements: list[Statement] = field(default_factory=list)
    forward_args: list[str] = field(default_factory=list)
    input_leaves: list[str | None] = field(default_factory=list)
    """Values fed by the leaves of the flattened forward inputs (None: a constant leaf)."""
    in_spec: str = ""
    input_constants: dict[str, object] = field(default_factory=dict)
    untraced_args: dict[str, object] = field(default_factory=dict)
    recompute: tuple[str, ...] = ()
    """Module paths recomputed in backward (from the plan)."""
    outputs: list[Any] = field(default_factory=list)
    out_spec: str = ""
    local_meta: dict[str, TensorMeta] = field(default_factory=dict)
    layouts: dict[str, Layout] = field(default_factory=dict)
    """Layout of every activation as produced (before conversions)."""
    module_classes: dict[str, str] = field(default_factory=dict)
    input_meta: dict[str, TensorMeta] = field(default_factory=dict)
    """Traced shape of every graph input (with `sym` for the dims that may change between calls)."""
    size_names: dict[str, list] = field(default_factory=dict)
    """Size name -> [input value, dim] (see Graph.size_names)."""
    shape_rules: list[ShapeRule] = field(default_factory=list)
    """Conditions on input sizes: found when tracing, then those the plan needs (divisible splits)."""
    static_shapes: bool = False
    constant_names: list[str] = field(default_factory=list)
    """Buffers holding tensors the forward creates from literals (values in constants.pt)."""
    grad_groups: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    """Weights held whole along plan axes over which every reader is split (on data dims): name -> those
    groups (GROUP or AxisGroup). Their gradients are partial sums there; the gradient reducer sums them
    over these axes together with the data-parallel replicas (no `copy_to_group` in the forward)."""

    def comm_count(self) -> dict[str, int]:
        """Number of each communication call in the forward (for tests and explanations)."""
        counts: dict[str, int] = {}
        for s in self.statements:
            if s.kind == "comm":
                counts[s.op] = counts.get(s.op, 0) + 1
        return counts
