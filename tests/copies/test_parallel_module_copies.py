"""Copies of a parallelized module (one rank): `copy.deepcopy` and `pickle` give a module that computes
with its own weights, eager or under `ComputeConfig.torch_compile`, with opaque leaf modules too; its
state dict loads into a copy.

Before the fix, torch_compile rebound the instance's `forward` to `torch.compile(<bound method>)`, a
function over the original module: a deep copy ran the original's weights (its gradients landed on
the original) and pickling failed ("not the same object as ...GenModel.forward"). Every [compiled]
case but test_capture_leaves_the_model_unpatched failed then; the [eager] cases passed already (eager, the generated module copies like any nn.Module; a leaf's structure copy is a
plain attribute holding meta tensors, and it runs on the copy's own tensors)."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch

import nnscaler
from nnscaler import ComputeConfig
from nnscaler.graph.capture.leaf_modules import LeafModuleWarning
from nnscaler.runtime.module_parts.compiled import CompiledMethod
from tests.copies.models import LeafNet, check_independent_copy, leaf_batch, loss_of, scramble

COMPILE = {"backend": "aot_eager"}


@pytest.fixture(scope="module", params=[False, COMPILE], ids=["eager", "compiled"])
def parallel(request, tmp_path_factory):
    """(the parallelized LeafNet, the model it came from); `pool` runs as an opaque leaf."""
    torch.manual_seed(0)
    model = LeafNet()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LeafModuleWarning)
        pm = nnscaler.parallelize(
            model,
            leaf_batch(0),
            "dp",
            ComputeConfig(1, 1, torch_compile=request.param),
            gen_savedir=tmp_path_factory.mktemp("gen"),
        )
    assert type(pm).leaf_modules == ("pool",)
    return pm, model


def _leaf_weights(pm) -> list[torch.nn.Parameter]:
    names = {n: p for n, p in pm.named_parameters()}
    return [names[local] for local, original in pm.dist_param_map.items() if original.startswith("pool.")]


def _all_weights(pm) -> list[torch.nn.Parameter]:
    return list(pm.parameters())


def _pickled(pm):
    return pickle.loads(pickle.dumps(pm))


@pytest.mark.parametrize("make_copy", [copy.deepcopy, _pickled], ids=["deepcopy", "pickle"])
@pytest.mark.parametrize("pick", [_leaf_weights, _all_weights], ids=["leaf", "all"])
def test_copy_computes_with_its_own_weights(parallel, make_copy, pick):
    pm, _ = parallel
    dup = check_independent_copy(pm, make_copy, leaf_batch(1), pick)
    if pm.compute_config.torch_compile:
        forward = dup.__dict__["forward"]
        assert isinstance(forward, CompiledMethod) and forward.module is dup


def test_the_leaf_of_a_copy_matches_eager_pytorch(parallel):
    """The copy's leaf runs its own code on its own tensors: it matches the model with the same weights."""
    pm, model = parallel
    dup = copy.deepcopy(pm)
    scramble(list(dup.parameters()), seed=3)
    reference = copy.deepcopy(model)
    own = reference.state_dict()  # (the parallel module's also holds its plan's extra state)
    reference.load_state_dict({k: v for k, v in dup.state_dict().items() if k in own})
    torch.testing.assert_close(dup(**leaf_batch(2)), reference(**leaf_batch(2)))


def test_state_dict_round_trip_into_a_copy(parallel):
    pm, _ = parallel
    dup = copy.deepcopy(pm)
    scramble(list(dup.parameters()), seed=5)
    assert loss_of(dup, leaf_batch(1)) != loss_of(pm, leaf_batch(1))
    dup.load_state_dict(pm.state_dict())
    assert loss_of(dup, leaf_batch(1)) == loss_of(pm, leaf_batch(1))
    scramble(_leaf_weights(dup), seed=6)  # loaded values, still its own tensors
    assert loss_of(dup, leaf_batch(1)) != loss_of(pm, leaf_batch(1))


def test_capture_leaves_the_model_unpatched(parallel):
    """The leaf's forward was rebound only while tracing: the model copies like any module."""
    _, model = parallel
    assert "forward" not in model.pool.__dict__
    check_independent_copy(model, copy.deepcopy, leaf_batch(1), lambda m: list(m.pool.parameters()))
