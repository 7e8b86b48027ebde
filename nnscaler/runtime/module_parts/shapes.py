"""Checks the generated forward runs on its inputs before anything else: each input's shape against
what the code was generated for, and the conditions the plan and the trace put on sizes.

A failed check raises ValueError naming the argument, its shape and the rule, instead of a reshape
or matmul error deep inside the generated code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["input_sizes", "check_shape"]


def input_sizes(
    owner: str, name: str, value: Any, expected: Sequence[int | None], static: bool | Sequence[int]
) -> tuple[int, ...]:
    """The sizes of input `name`, checked: `expected[d]` None accepts any size, an int must match.

    static: the code was generated with constant_folding=True; True: every size is fixed (the model
    was traced with fixed sizes), a tuple: the dims whose sizes the code computes with (folded).
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{owner}.forward: {name} must be a tensor (it was one when traced), got {type(value).__name__}"
        )
    shape = tuple(value.shape)
    if len(shape) != len(expected):
        raise ValueError(
            f"{owner}.forward: {name} has shape {list(shape)} ({len(shape)} dims), but the code was generated "
            f"for {len(expected)} dims (traced shape {_shown(expected)}); pass a tensor with as many dims"
        )
    for d, (got, want) in enumerate(zip(shape, expected)):
        if want is not None and got != want:
            raise ValueError(
                f"{owner}.forward: {name} has shape {list(shape)}, but dim {d} must be {want} "
                f"(generated for {_shown(expected)}): {_why_fixed(static, d)}"
            )
    return shape


def _why_fixed(static: bool | Sequence[int], dim: int) -> str:
    if static is True:
        return (
            "the code was generated with constant_folding=True and the model traced with every input size "
            "fixed; pass inputs of the traced shape or parallelize with constant_folding=False"
        )
    if static and dim in static:
        return (
            "the code was generated with constant_folding=True, which writes the sizes the model computes "
            "with (view shapes, arange ends, split sizes) as constants; pass inputs of this size or "
            "parallelize with constant_folding=False"
        )
    return (
        "this dim was fixed when tracing (the model needs it fixed: it meets a weight's size, "
        "or the model branches on it); pass inputs of that size or trace with this one"
    )


def check_shape(owner: str, holds: bool, rule: str, why: str, inputs: dict[str, Any]) -> None:
    """Raise unless `holds`, the value of the condition `rule` over the input sizes."""
    if holds:
        return
    shapes = ", ".join(f"{k} has shape {list(v.shape)}" for k, v in inputs.items())
    raise ValueError(
        f"{owner}.forward: {shapes}, which breaks the rule `{rule}` ({why}); "
        "`<input>_size<d>` is dim d of that input. Pass inputs that meet it, or parallelize with another plan"
    )


def _shown(expected: Sequence[int | None]) -> str:
    return "[" + ", ".join("*" if e is None else str(e) for e in expected) + "]"
