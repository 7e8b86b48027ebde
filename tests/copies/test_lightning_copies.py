"""NnScalerStrategy rebinds the LightningModule's `forward` to its parallel module: a deepcopy or pickle
of the trained LightningModule (an EMA or teacher copy, Lightning's WeightAveraging) computes with
the copy's own parallel module. NnScalerFabricStrategy's rebinding (the parallel module itself as
forward) copies too. One process (ComputeConfig(1, 1), devices=1).

Before the fix the rebound forward was a closure over the original parallel module: the copy's
output did not change when its weights were zeroed: all three tests failed ([pickle] with "Can't pickle
local object 'NnScalerStrategy._parallelize.<locals>.parallel_forward'")."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from nnscaler import ComputeConfig
from nnscaler.integration.lightning.pytorch import NnScalerPrecision, NnScalerStrategy
from nnscaler.integration.lightning.pytorch.parallel_forward import ParallelForward
from tests.copies.models import check_independent_copy
from tests.integration.lightning_case import Regressor, loader


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    import lightning.pytorch as pl

    root = tmp_path_factory.mktemp("lightning")
    strategy = NnScalerStrategy(
        compute_config=ComputeConfig(1, 1), pas_policy="dp", gen_savedir=str(root / "gen")
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=strategy,
        plugins=[NnScalerPrecision("32-true")],
        max_steps=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(root),
    )
    model = Regressor()
    trainer.fit(model, loader())
    return model


def _pickled(module):
    return pickle.loads(pickle.dumps(module))


@pytest.mark.parametrize("make_copy", [copy.deepcopy, _pickled], ids=["deepcopy", "pickle"])
def test_copy_computes_with_its_own_weights(trained, make_copy):
    dup = check_independent_copy(
        trained, make_copy, dict(trained.dummy_forward_args), lambda m: list(m.parameters())
    )
    forward = dup.__dict__["forward"]
    assert isinstance(forward, ParallelForward) and forward.module is dup
    assert dup.nnscaler_module is not trained.nnscaler_module


def test_state_dict_round_trip_into_a_copy(trained):
    batch = dict(trained.dummy_forward_args)
    dup = copy.deepcopy(trained)
    with torch.no_grad():
        for p in dup.parameters():
            p.zero_()
        assert float(dup(**batch)) != float(trained(**batch))
        dup.load_state_dict(trained.state_dict())
        assert float(dup(**batch)) == float(trained(**batch))


@pytest.fixture(scope="module")
def fabric_module(tmp_path_factory):
    """The user's module after NnScalerFabricStrategy set it up (its forward is the parallel module)."""
    import lightning as L

    from nnscaler.integration.lightning.fabric import NnScalerFabricStrategy

    root = tmp_path_factory.mktemp("fabric")
    strategy = NnScalerFabricStrategy(
        compute_config=ComputeConfig(1, 1), pas_policy="dp", gen_savedir=str(root)
    )
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    module = Regressor()
    model, _ = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    model(**module.dummy_forward_args).backward()
    return module


def test_fabric_module_deepcopy_computes_with_its_own_weights(fabric_module):
    """Fabric rebinds forward to the parallel module itself, an object already: this passed before.
    (pickle: Fabric's own `_fabric` attribute on the module cannot be pickled, with any strategy.)"""
    batch = dict(fabric_module.dummy_forward_args)
    dup = check_independent_copy(fabric_module, copy.deepcopy, batch, lambda m: list(m.parameters()))
    assert dup.__dict__["forward"] is dup.nnscaler_module
