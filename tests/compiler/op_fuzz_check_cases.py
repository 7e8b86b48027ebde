"""Fuzz cases (tests/compiler/test_op_fuzz.py) for the ops of issue 40's value checks and CTC head:
the check op itself (its 0-d condition is never split), `x.max()` / `.min()` / `.all()` / `.any()` over
every element, `torch.isfinite`, and
`aten.ctc_loss` (split by the batch for padded targets and tensor lengths)."""

from __future__ import annotations

import torch

from nnscaler.graph.capture.value_checks import trace_value_checks
from tests.compiler.op_fuzz_cases import Draw, Maker, cases

__all__ = ["CHECK_CASES"]


def _value_check(d: Draw) -> list[tuple]:
    with trace_value_checks():  # defines torch.ops.nnscaler_check.value_check
        pass
    return [
        (torch.tensor(False), True, "ValueError", "labels must be < 12", "m.py:3"),
        (torch.tensor(True), False, "AssertionError", "", "m.py:4"),
        # element-wise (graph/capture/local_checks.py): split like the tensor it reads
        (torch.zeros(d.n(), d.n(), dtype=torch.bool), True, "ValueError", "x", "m.py:5"),
        (torch.ones(d.n(), d.n(), 2, dtype=torch.bool), False, "AssertionError", "y", "m.py:6"),
    ]


def _all_elements(d: Draw) -> list[tuple]:
    return [(d.f(d.n(), d.n()),), (d.f(d.n()),), (torch.randint(0, 9, (d.n(), 3), generator=d.gen),)]


def _bools(d: Draw) -> list[tuple]:
    return [(d.f(d.n(), d.n()) > 0,), (d.f(d.n()) > -9,), (torch.zeros(d.n(), 2, dtype=torch.bool),)]


def _finite(d: Draw) -> list[tuple]:
    x = d.f(d.n(), d.n())
    x[0, 0], x[-1, -1] = float("inf"), float("nan")
    return [(x,), (d.f(d.n()),)]


def _ctc(d: Draw) -> list[tuple]:
    """log_probs (T, N, C), targets (N, S) in 1..C-1, lengths as tensors (and once as lists)."""
    t, n, c, s = 12, d.n(), 5, 3
    log_probs = torch.log_softmax(d.f(t, n, c, dtype=torch.float32), -1)
    targets = torch.randint(1, c, (n, s), generator=d.gen)
    lengths = torch.full((n,), t, dtype=torch.long)
    target_lengths = torch.randint(1, s + 1, (n,), generator=d.gen)
    return [
        (log_probs, targets, lengths, target_lengths),
        (log_probs, targets, lengths, target_lengths, 0, 2),  # sum
        (log_probs, targets, lengths, target_lengths, 0, 0),  # none: per sample
        (log_probs, targets.flatten(), lengths, torch.full((n,), s, dtype=torch.long)),  # 1-D targets: whole
    ]


def _ctc_lists(d: Draw) -> list[tuple]:
    t, n, c, s = 12, d.n(), 5, 3
    log_probs = torch.log_softmax(d.f(t, n, c, dtype=torch.float32), -1)
    return [(log_probs, torch.randint(1, c, (n, s), generator=d.gen), [t] * n, [s] * n)]


CHECK_CASES: dict[str, Maker] = {
    "nnscaler_check.value_check.default": cases(_value_check),
    "aten.max.default": cases(_all_elements),
    "aten.min.default": cases(_all_elements),
    "aten.all.default": cases(_bools),
    "aten.any.default": cases(_bools),
    "aten.isfinite.default": cases(_finite),
    "aten.ctc_loss.Tensor": cases(_ctc),
    "aten.ctc_loss.IntList": cases(_ctc_lists),
}
