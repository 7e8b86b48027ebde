"""Names the dummy inputs' keys may have (issue 41): each key becomes a parameter of the generated
forward, so it must be a Python identifier that is not a keyword, not `self`, and, when it is a key
the model's `**kwargs` takes (a name the user chose), not a name the generated module uses itself
(codegen/templates/gencode.py.j2's imports and constants)."""

from __future__ import annotations

import inspect
import keyword
from collections.abc import Iterable

from nnscaler.errors import TraceError

__all__ = ["TEMPLATE_GLOBALS", "GENERATED_NAMES", "check_input_keys"]

TEMPLATE_GLOBALS = frozenset(
    {"math", "torch", "F", "ckpt", "pytree", "ParallelModule", "comm", "PipelineStep", "TensorSpec"}
    | {"sync_norm", "rng", "nnscaler", "_IN_SPEC", "_OUT_SPEC"}
)
"""The imports and constants every generated file (codegen/templates/gencode.py.j2) binds at module
level; codegen's layer functions read them as globals too."""

GENERATED_NAMES = TEMPLATE_GLOBALS | {"GenModel", "leaves", "spec"}
"""Module-level names of the generated file and the locals its input lines bind (a parameter of that
name would shadow them)."""


def check_input_keys(
    owner: str, keys: Iterable[str], var_keyword: Iterable[str], sig: inspect.Signature
) -> None:
    """Refuse a key the generated forward cannot take as a parameter; `var_keyword`: the keys that go to
    forward's `**kwargs` (names the user chose, so they may be renamed)."""
    var_keyword = set(var_keyword)
    for key in keys:
        if not isinstance(key, str):
            why = "is not a string"
        elif not key.isidentifier() or keyword.iskeyword(key):
            why = "is not a Python identifier (the generated forward takes every key as a parameter)"
        elif key == "self":
            why = "is the generated module's `self`"
        elif key in var_keyword and key in GENERATED_NAMES:
            why = "is a name the generated code uses itself"
        else:
            continue
        raise TraceError(
            f"dummy_forward_args key {key!r} {why}; {owner}.forward{sig} takes it through **kwargs: rename "
            "the key (and read it under the new name), or pass the value another way"
        )
