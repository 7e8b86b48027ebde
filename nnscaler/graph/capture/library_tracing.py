"""Trace-time choices of well-known model libraries, made as in an eager run.

transformers materialises a full boolean causal mask whenever it sees torch.export, in case the
exported program later runs with another sequence length. nnscaler keeps input sizes symbolic and
checks the trace's shape guards at call time (a call that would take another branch is an error), so
the choice transformers makes in eager mode holds for every call the generated code accepts: no mask
and `is_causal=True` when nothing is padded, which lets SDPA use its flash / memory-efficient kernels
on GPU and skip the masked half of the scores. Grouped-query attention keeps SDPA's `enable_gqa` where
transformers chooses it (no mask): no copies of the key/value heads, and tensor parallelism splits
by kv-head group (`graph/ops/attention.py`).

Padding masks given as inputs are still traced tensors and still become explicit masks. Packed
sequences are looked for only in position ids the caller passes (transformers otherwise makes them
with arange, which holds one sequence per row).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

__all__ = ["static_shape_choices"]


def _values_unknown(is_tracing: Callable[..., bool]) -> Callable[..., bool]:
    """transformers' `is_tracing(tensor)` answers True for any call under torch.export (through
    `is_torchdynamo_compiling`, in 5.17 and earlier: its masks then skip nothing, and a causal model
    runs SDPA with a full S x S mask instead of the causal kernel: several times slower in backward at
    long sequences). What its mask code asks is whether a tensor's values are unknown while tracing:
    never for a tensor that is not there (no padding mask), still for a mask given as an input."""

    def values_unknown(tensor: Any = None) -> bool:
        return tensor is not None and is_tracing(tensor)

    return values_unknown


# (module, attribute, replacement given the original): each patched only where the installed
# version has it
_PATCHES: tuple[tuple[str, str, Callable[[Any], Any]], ...] = (
    ("transformers.masking_utils", "is_torchdynamo_exporting", lambda original: lambda: False),
    ("transformers.masking_utils", "is_tracing", _values_unknown),
)


@contextmanager
def static_shape_choices(forward_kwargs: dict) -> Iterator[None]:
    """Inside: libraries already imported by the model choose as they would when run eagerly."""
    patches = list(_PATCHES)
    if "position_ids" not in forward_kwargs:
        patches.append(
            (
                "transformers.masking_utils",
                "find_packed_sequence_indices",
                lambda original: lambda *args, **kwargs: None,
            )
        )
    with ExitStack() as stack:
        for module_name, attr, replace in patches:
            module = sys.modules.get(module_name)
            if module is not None and hasattr(module, attr):
                stack.enter_context(mock.patch.object(module, attr, replace(getattr(module, attr))))
        yield
