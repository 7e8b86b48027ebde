"""`use_moe_op` rebinds each experts module's `forward` to the `moe_experts` op: copies of the model
(deepcopy, pickle, a state dict loaded into another instance) compute with their own experts.

Before the fix the rebound forward was a closure over the original module: a deep copy ran the
original's experts (zeroing the copy's left its loss unchanged; its gradients landed on the
original), and pickling failed ("Can't pickle local object"). test_deepcopy_*, test_pickle_*,
test_copy_stays_switched_* and test_state_dict_into_a_deep_copy failed then;
test_state_dict_into_a_fresh_model and test_capture_leaves_no_rebound_forward passed already."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from nnscaler.graph.capture import capture
from nnscaler.graph.capture.moe import ExpertsOpForward, use_moe_op
from tests.copies.models import MoeBlock, check_independent_copy, loss_of, moe_batch


def _switched(seed: int = 0, capacity_factor: float | None = None) -> MoeBlock:
    torch.manual_seed(seed)
    model = MoeBlock()
    assert use_moe_op(model, capacity_factor=capacity_factor) == ["experts"]
    return model


def _experts(model) -> list[torch.nn.Parameter]:
    return [model.experts.gate_up_proj, model.experts.down_proj]


def _pickled(model):
    return pickle.loads(pickle.dumps(model))


@pytest.mark.parametrize("make_copy", [copy.deepcopy, _pickled], ids=["deepcopy", "pickle"])
def test_copy_runs_its_own_experts_and_gets_their_gradients(make_copy):
    model = _switched()
    dup = check_independent_copy(model, make_copy, moe_batch(), _experts)
    with torch.no_grad():  # the check: zeroed experts give a zero output
        dup.experts.gate_up_proj.zero_()
    assert loss_of(dup, moe_batch()) == 0.0
    assert loss_of(model, moe_batch()) > 0.0


def test_deepcopy_of_the_experts_module_alone():
    model = _switched()
    experts = copy.deepcopy(model.experts)
    hidden, index = torch.randn(5, 8), torch.tensor([[0, 1]] * 5)
    weights = torch.full((5, 2), 0.5)
    with torch.no_grad():
        experts.down_proj.zero_()
    assert experts(hidden, index, weights).abs().sum() == 0
    assert model.experts(hidden, index, weights).abs().sum() > 0


@pytest.mark.parametrize("make_copy", [copy.deepcopy, _pickled], ids=["deepcopy", "pickle"])
def test_copy_stays_switched_with_its_capacity_factor(make_copy):
    dup = make_copy(_switched(capacity_factor=0.75))
    forward = dup.experts.__dict__["forward"]
    assert isinstance(forward, ExpertsOpForward)
    assert forward.module is dup.experts and forward.capacity_factor == 0.75
    # capture sees the copy as switched (it keeps the capacity rule, not the dropless default)
    graph = capture(dup, moe_batch(), both_modes=False)
    nodes = [n for n in graph.nodes if "moe_experts" in str(n.op)]
    assert len(nodes) == 1 and 0.75 in [*nodes[0].args, *nodes[0].kwargs.values()], nodes


def test_state_dict_into_a_fresh_model():
    model, other = _switched(0), _switched(1)
    assert loss_of(other, moe_batch()) != loss_of(model, moe_batch())
    other.load_state_dict(model.state_dict())
    assert loss_of(other, moe_batch()) == loss_of(model, moe_batch())


def test_state_dict_into_a_deep_copy():
    model, other = _switched(0), _switched(1)
    dup = copy.deepcopy(model)
    dup.load_state_dict(other.state_dict())
    assert loss_of(dup, moe_batch()) == loss_of(other, moe_batch())
    assert loss_of(dup, moe_batch()) != loss_of(model, moe_batch())


def test_capture_leaves_no_rebound_forward():
    """Capture switches unswitched experts itself (experts_as_op) and puts their forward back."""
    torch.manual_seed(0)
    model = MoeBlock()
    capture(model, moe_batch(), both_modes=False)
    assert "forward" not in model.experts.__dict__
    check_independent_copy(model, copy.deepcopy, moe_batch(), _experts)


class _Loss(torch.nn.Module):
    """A transformers model's `.loss` as the output."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **batch):
        return self.model(**batch).loss


def test_tiny_mixtral_deepcopy_uses_its_own_experts():
    from tests import models_moe

    model, make_batch = models_moe.build_mixtral(0)
    assert len(use_moe_op(model)) == 2

    def experts(m):
        return [p for n, p in m.named_parameters() if ".experts." in n]

    check_independent_copy(_Loss(model), copy.deepcopy, make_batch(0, 2), experts)
