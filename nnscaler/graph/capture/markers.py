"""nnScaler's tracing markers, kept so models written for nnScaler trace unchanged.

nnScaler records `anchor(name)` as a node (custom policies place pipeline stages at anchors) and
uses `constant_folding()` / `no_constant_folding()` / `fold_constant(x)` to steer which values its
tracer folds into constants. Here torch.export traces the model: folding is decided for the whole
module by `ComputeConfig.constant_folding`, and stages are placed at module boundaries
(`pas_config['pipeline_pivots']`, docs/pipeline.md). So these run as plain Python: `anchor` is a
no-op that says so once, the folding switches are no-op scopes, `fold_constant` returns its input.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

__all__ = ["anchor", "constant_folding", "no_constant_folding", "fold_constant"]

T = TypeVar("T")
_warned: set[str] = set()


def _once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        warnings.warn(message, stacklevel=3)


def anchor(name: str) -> None:
    """nnScaler's stage-boundary marker. Accepted and ignored: pipeline stages here start at module
    boundaries; name them with `pas_config['pipeline_pivots']` (the module class, e.g. 'LlamaDecoderLayer')."""
    if not isinstance(name, str):
        raise TypeError(f"nnscaler.anchor(name) takes a string, got {type(name).__name__}")
    _once(
        "anchor",
        f"nnscaler.anchor({name!r}) has no effect here: pipeline stages start at module boundaries; "
        "choose them with pas_config['pipeline_pivots'] (see docs/pipeline.md)",
    )


@contextmanager
def constant_folding(constant_folding: bool = True) -> Iterator[None]:
    """nnScaler's folding scope. A no-op here: `ComputeConfig.constant_folding` decides for the module
    (True: sizes are fixed to the traced ones; False, the default: sizes follow the inputs)."""
    yield


@contextmanager
def no_constant_folding() -> Iterator[None]:
    """nnScaler's scope that keeps values symbolic. A no-op here: sizes derived from the inputs stay
    symbolic unless `ComputeConfig.constant_folding=True`."""
    yield


def fold_constant(a: T) -> T:
    """nnScaler's marker for a value to fold into a constant: returns `a` (values that do not depend on
    the inputs become constants of the generated code when traced)."""
    return a
