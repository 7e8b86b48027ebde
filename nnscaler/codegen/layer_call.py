"""A call of a layer function, standing in a forward body for one repeated layer's statements:

    add_12 = self._layer_LlamaDecoderLayer(_LayerParams(self, "model_layers_1_"), add_6, to_2, to_3, input_ids_size1)

It has a statement's fields (module path, outputs, args), so the body writer, recompute regions and
liveness treat it as one line that reads the layer's inputs and binds its outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nnscaler.codegen.safe_text import literal

__all__ = ["FreeName", "LayerCall", "PARAMS_CLASS", "is_random"]

PARAMS_CLASS = "_LayerParams"
"""The generated file's class giving a layer function one layer's weights: p.x is self.<prefix>x."""


@dataclass(frozen=True)
class FreeName:
    """A name the layer's code reads from the calling method that is no value: an input size."""

    name: str


@dataclass
class LayerCall:
    function: str
    """The method of the generated module holding the layer's code."""
    prefix: str
    """The layer's weights are the module's attributes named prefix + the name the code uses."""
    args: tuple[Any, ...]
    """Refs (the layer's inputs, in the function's order), then FreeNames."""
    outputs: list[str]
    module_path: str
    module_class: str
    uses_rng: bool = False
    """The layer draws random numbers (a recompute region around it replays the generators)."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    kind: str = "layer"
    op: str = "layer"
    source: str = ""
    note: str = ""
    no_grad: bool = False
    shard_rng: bool = False
    tuple_output: bool = False

    def call_args(self, fmt) -> list[str]:
        """The function and its arguments, as torch.utils.checkpoint takes them."""
        args = [a.name if isinstance(a, FreeName) else fmt(a) for a in self.args]
        return [f"self.{self.function}", f"{PARAMS_CLASS}(self, {literal(self.prefix)})", *args]

    def lhs(self, fmt) -> str:
        return ", ".join(fmt.local(o) for o in self.outputs)

    def code(self, fmt) -> str:
        fn, *args = self.call_args(fmt)
        call = f"{fn}({', '.join(args)})"
        return f"{self.lhs(fmt)} = {call}" if self.outputs else call


def is_random(s) -> bool:
    """Whether a statement (or a layer call) draws random numbers from the shard generator."""
    return bool(getattr(s, "uses_rng", False) or s.shard_rng or s.op.startswith("rng."))
