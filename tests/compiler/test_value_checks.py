"""Value checks that only raise are traced through (issue 40; graph/capture/value_checks.py).

`if labels.max() >= vocab: raise ValueError(...)`, `assert cond, msg` and `torch._assert(cond, msg)`
read a tensor's value, which torch.export refuses; capture takes the non-raising branch as an
assumption, so the model stays one graph (no opaque leaf), and the generated code checks it again
(nnscaler.runtime.checks), raising the model's own exception and message and naming the line.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import nnscaler
from nnscaler import ComputeConfig
from nnscaler.errors import TraceError
from nnscaler.graph.capture import capture
from nnscaler.graph.capture.leaf_modules import LeafModuleWarning
from nnscaler.graph.ops.check import VALUE_CHECK_OP
from nnscaler.graph.ops.leaf import is_leaf_op
from tests.models_ctc import VOCAB, bad_batch, build_speech_ctc


class LabelError(Exception):
    """The model's own exception type."""


class Checked(nn.Module):
    """Every supported form of a check that only raises, each failing on its own bad input."""

    def __init__(self, limit: int = 10):
        super().__init__()
        self.limit = limit
        self.fc = nn.Linear(4, 3)

    def forward(self, x, ids):
        if ids.max() >= self.limit:
            raise LabelError(f"ids must be < {self.limit}")
        if not (ids.min() >= 0):
            raise ValueError("ids must be >= 0")
        assert torch.isfinite(x).all(), "x has inf or nan"
        torch._assert(ids.numel() == 0 or ids[0] != 7, "the first id must not be 7")
        if x.abs().max().item() > 1e6 or ids.sum() == 30:
            raise ValueError(
                f"x too large: {x.abs().max()}"
            )  # reads a tensor: its source text is the message
        return self.fc(x).sum() + ids.float().mean()


def _batch(ids=(1, 2, 3, 4), x=None):
    return {"x": torch.ones(4, 4) if x is None else x, "ids": torch.tensor(ids)}


def _checks(graph):
    return [n for n in graph.nodes if n.op == VALUE_CHECK_OP]


def test_ctc_model_captures_as_one_graph_with_its_label_check():
    model, make_batch = build_speech_ctc()
    with warnings.catch_warnings():
        warnings.simplefilter("error", LeafModuleWarning)  # no part of the model becomes opaque
        graph = capture(model, make_batch(1, 4))
    assert not any(is_leaf_op(n.op) for n in graph.nodes)
    (check,) = _checks(graph)
    _, raise_when, exc, message, where = check.args
    assert (raise_when, exc) == (True, "ValueError")
    assert message == f"labels must be < {VOCAB} (the CTC head's vocabulary)"
    assert where.startswith("models_ctc.py:") and "if labels.max() >= self.vocab_size:" in where
    assert "aten.ctc_loss.Tensor" in {n.op for n in graph.nodes}  # the loss is one op too


def test_every_form_is_recorded_with_its_exception_and_message():
    graph = capture(Checked(), _batch())
    found = [(n.args[1], n.args[2], n.args[3]) for n in _checks(graph)]
    assert found[:2] == [
        (True, f"{__name__}:LabelError", "ids must be < 10"),
        (False, "ValueError", "ids must be >= 0"),  # `not c`: raises unless c
    ]
    assert found[2] == (False, "AssertionError", "x has inf or nan")
    assert found[3] == (False, "AssertionError", "the first id must not be 7")
    # `a or b` in an if: each checked on its own; `.item() > n` compares as a tensor
    assert [f[:2] for f in found[4:]] == [(True, "ValueError"), (True, "ValueError")]
    assert found[4][2] == "raise ValueError(f'x too large: {x.abs().max()}')"


def test_generated_module_raises_the_models_message_and_runs_good_inputs(tmp_path):
    torch.manual_seed(0)
    model = Checked()
    ref = copy.deepcopy(model)
    pm = nnscaler.parallelize(model, _batch(), "dp", ComputeConfig(1, 1), gen_savedir=tmp_path)
    source = next(tmp_path.rglob("gencode0.py")).read_text()
    assert "import nnscaler.runtime.checks" in source
    assert "nnscaler.runtime.checks.raise_if(" in source and "nnscaler.runtime.checks.raise_unless(" in source
    good = _batch((3, 1, 2, 0))
    torch.testing.assert_close(pm(**good), ref(**good))
    with pytest.raises(LabelError, match=r"^ids must be < 10\n") as info:
        pm(**_batch((1, 2, 30, 4)))
    assert str(info.value) == "ids must be < 10"  # the model's message; the note names the line
    assert any(
        "test_value_checks.py:" in note and "ids.max() >= self.limit" in note for note in info.value.__notes__
    )
    with pytest.raises(ValueError, match=r"^ids must be >= 0\n"):
        pm(**_batch((1, -2, 3, 4)))
    with pytest.raises(AssertionError, match=r"^x has inf or nan\n"):
        pm(**_batch(x=torch.full((4, 4), float("inf"))))
    with pytest.raises(AssertionError, match=r"^the first id must not be 7\n"):
        pm(**_batch((7, 1, 1, 1)))
    with pytest.raises(ValueError, match=r"x too large"):
        pm(**_batch(x=torch.full((4, 4), 1e7)))
    with pytest.raises(ValueError, match=r"x too large"):  # the other operand of the `or`
        pm(**_batch((9, 9, 9, 3)))


def test_ctc_generated_code_checks_labels_on_cpu(tmp_path):
    model, make_batch = build_speech_ctc()
    ref = copy.deepcopy(model)
    pm = nnscaler.parallelize(model, make_batch(1, 4), "dp", ComputeConfig(1, 1), gen_savedir=tmp_path)
    batch = make_batch(2, 3)  # another batch size: sizes stay open
    torch.testing.assert_close(pm(**batch), ref(**batch))
    with pytest.raises(ValueError, match=rf"^labels must be < {VOCAB} \(the CTC head's vocabulary\)\n"):
        pm(**bad_batch(3, 4))


class AndCheck(nn.Module):
    """`if a and b: raise` cannot be taken apart (either operand may make it pass): not an assumption."""

    def forward(self, x):
        if (x > 0).all() and x.sum() > 100:
            raise ValueError("too large")
        return x * 2


class Branch(nn.Module):
    """An `if` on a value whose body computes: real data-dependent control flow."""

    def forward(self, x):
        if x.sum() > 0:
            x = x * 2
        return x + 1


class CallTestsTruth(nn.Module):
    """`all([a, b])` tests each operand's truth inside the call: not the `if`'s own test."""

    def forward(self, x):
        if all([(x > 0).all(), x.sum() > 100]):
            raise ValueError("too large")
        return x * 2


@pytest.mark.parametrize("model", [AndCheck(), Branch(), CallTestsTruth()], ids=["and", "branch", "call"])
def test_other_reads_of_values_still_fail_as_data_dependent(model):
    with pytest.raises(TraceError, match="data-dependent"):
        capture(model, {"x": torch.ones(3)}, auto_leaf_modules=False)


class ActivationChecks(nn.Module):
    """Checks on computed tensors: made element-wise (graph/capture/local_checks.py) where exact."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 6)

    def forward(self, x, ids):
        h = self.fc(x)
        assert torch.isfinite(h).all(), "h is not finite"
        if torch.logical_not((ids * 2).min() >= 0):
            raise ValueError("doubled ids are negative")
        if h.abs().max() > 1e6:  # a float max (NaN propagates): kept whole
            raise ValueError("h too large")
        return h.sum()


def test_checks_on_computed_tensors_become_element_wise(tmp_path):
    graph = capture(ActivationChecks(), _batch())
    ops = [n.op for n in graph.nodes]
    assert "aten.all.default" not in ops and "aten.logical_not.default" not in ops
    assert ops.count("aten.min.default") == 0 and ops.count("aten.max.default") == 1
    finite, doubled, large = _checks(graph)
    assert graph.values[finite.args[0].name].meta.shape == (4, 6) and finite.args[1] is False
    # not(min(2 ids) >= 0) raises  <=>  some element of 2 ids >= 0 is false
    assert graph.values[doubled.args[0].name].meta.shape == (4,) and doubled.args[1] is False
    assert graph.values[large.args[0].name].meta.shape == ()
    torch.manual_seed(0)
    model = ActivationChecks()
    pm = nnscaler.parallelize(model, _batch(), "dp", ComputeConfig(1, 1), gen_savedir=tmp_path)
    torch.testing.assert_close(pm(**_batch()), model(**_batch()))
    with pytest.raises(AssertionError, match="^h is not finite"):
        pm(**_batch(x=torch.full((4, 4), float("nan"))))
    with pytest.raises(ValueError, match="^doubled ids are negative"):
        pm(**_batch((1, 2, -3, 4)))
    with pytest.raises(ValueError, match="^h too large"):
        pm(**_batch(x=torch.full((4, 4), 1e9)))


def test_checks_on_the_forwards_inputs_stay_whole():
    graph = capture(Checked(), _batch())
    first = _checks(graph)[0]  # ids.max() >= limit: ids are whole on every rank
    assert graph.values[first.args[0].name].meta.shape == ()
    assert "aten.max.default" in [n.op for n in graph.nodes]
