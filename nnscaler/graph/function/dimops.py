"""nnScaler 0.8's `nnscaler.graph.function.dimops` import path: IRDimops (an annotated op of the policy
API) and the annotation classes its scripts name. DimopSplit and TransformRule exist so scripts that
build custom transform rules import; register_op refuses transform_rules (ops split along their
annotation's dims)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nnscaler.graph.ops.annotation import DimAnno, OpAnno, TensorAnno
from nnscaler.graph.policy_api import IRDimops

__all__ = ["IRDimops", "DimAnno", "ShapeAnno", "OpAnno", "DimopSplit", "TransformRule"]

ShapeAnno = TensorAnno
"""nnScaler's name for one tensor's annotation."""


@dataclass(frozen=True)
class DimopSplit:
    """How a transform rule splits one tensor: replicate (R), value split (V) or split dims (D)."""

    dims: tuple[int, ...] = ()
    r: bool = False
    v: bool = False

    def isR(self) -> bool:  # noqa: N802 (nnScaler's names)
        return self.r

    def isD(self) -> bool:  # noqa: N802
        return bool(self.dims)

    def isV(self) -> bool:  # noqa: N802
        return self.v

    @staticmethod
    def R() -> DimopSplit:  # noqa: N802
        return DimopSplit(r=True)

    @staticmethod
    def V() -> DimopSplit:  # noqa: N802
        return DimopSplit(v=True)

    @staticmethod
    def D(dims: int | list[int]) -> DimopSplit:  # noqa: N802
        return DimopSplit(dims=tuple(dims) if isinstance(dims, (list, tuple)) else (dims,))


@dataclass(frozen=True)
class TransformRule:
    """A custom split rule: per-input and per-output DimopSplits and an optional kwargs modifier."""

    inputs: tuple[DimopSplit, ...]
    outputs: tuple[DimopSplit, ...]
    modifier: Any = None
