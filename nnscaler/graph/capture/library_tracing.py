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
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from unittest import mock

__all__ = ["static_shape_choices"]

# (module, attribute, replacement): each patched only where the installed version has it
_PATCHES = (("transformers.masking_utils", "is_torchdynamo_exporting", lambda: False),)


@contextmanager
def static_shape_choices(forward_kwargs: dict) -> Iterator[None]:
    """Inside: libraries already imported by the model choose as they would when run eagerly."""
    patches = list(_PATCHES)
    if "position_ids" not in forward_kwargs:
        patches.append(
            ("transformers.masking_utils", "find_packed_sequence_indices", lambda *args, **kwargs: None)
        )
    with ExitStack() as stack:
        for module_name, attr, replacement in patches:
            module = sys.modules.get(module_name)
            if module is not None and hasattr(module, attr):
                stack.enter_context(mock.patch.object(module, attr, replacement))
        yield
