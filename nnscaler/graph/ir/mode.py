"""An op argument that follows the module's train()/eval() mode at run time."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ModeValue"]


@dataclass(frozen=True)
class ModeValue:
    """A literal argument whose value the trace found to depend on the module's mode.

    E.g. dropout's `train` (True in train mode, False in eval mode), batch norm's `training`, an
    attention `dropout_p` written `p if self.training else 0.0`, or the step added to batch norm's
    `num_batches_tracked` (1 when training, 0 otherwise). Generated code reads `self.training`.
    A ModeValue is truthy: planning treats the op as possibly training (e.g. batch norm's batch dim
    is not split, because its statistics span the batch in train mode).
    """

    train: Any
    eval: Any

    def render(self, fmt: Callable[[Any], str]) -> str:
        """Python code for the value, rendering the two literals with `fmt`."""
        if self.train is True and self.eval is False:
            return "self.training"
        if self.train is False and self.eval is True:
            return "(not self.training)"
        return f"({fmt(self.train)} if self.training else {fmt(self.eval)})"
