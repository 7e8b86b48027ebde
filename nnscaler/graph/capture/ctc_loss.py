"""Let `F.ctc_loss` trace as one op (`aten.ctc_loss.Tensor` / `.IntList`).

torch has no fake kernel for `aten._ctc_loss` (its second output, the forward variables `log_alpha`,
is sized by the longest target, a value), so torch.export fails on every model computing a CTC loss
("DynamicOutputShapeException: aten._ctc_loss.Tensor"). While capturing, `ctc_loss_shapes()` gives it
one: `log_alpha` sized by the padded target length (an upper bound, only ever read by ctc_loss's own
backward, which the generated code runs eagerly). export then keeps `aten.ctc_loss` as one op (the
loss is its only output), which splits by the batch (graph/ops/ctc.py), and the generated code calls
it as the model did.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from nnscaler.graph.ops import ctc  # noqa: F401  (its op rule: split by the batch)

__all__ = ["ctc_loss_shapes"]


def _fake_ctc(log_probs, targets, input_lengths, target_lengths, blank=0, zero_infinity=False):
    batch = log_probs.shape[1] if log_probs.dim() == 3 else 1
    longest = targets.shape[-1] if targets.dim() == 2 else targets.shape[0]
    loss = log_probs.new_empty((batch,) if log_probs.dim() == 3 else ())
    return loss, log_probs.new_empty((batch, log_probs.shape[0], 2 * longest + 1))


@contextlib.contextmanager
def ctc_loss_shapes() -> Iterator[None]:
    """Within the block, fake tensors (tracing) can run `aten._ctc_loss`; torch's behaviour after."""
    lib = torch.library.Library("aten", "FRAGMENT")
    try:
        for overload in ("aten::_ctc_loss", "aten::_ctc_loss.Tensor"):
            torch.library.register_fake(overload, _fake_ctc, lib=lib, allow_override=True)
        yield
    finally:
        lib._destroy()
