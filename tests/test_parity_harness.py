"""The parity harness's own checks, without the compiler: it passes what matches, names what doesn't."""

from __future__ import annotations

import copy

import pytest
import torch

from tests import zoo
from tests.parity import _batch_seed, _cat_batches, compare, train_reference


def _fake_results(losses: list[float], model: torch.nn.Module, plan_ngpus: int, world: int) -> list[dict]:
    merged = {k: v.clone() for k, v in model.state_dict().items()}
    return [
        {"rank": r, "replica": r // plan_ngpus, "losses": list(losses), "merged": merged if r == 0 else None}
        for r in range(world)
    ]


@pytest.fixture(scope="module")
def reference() -> tuple[list[float], torch.nn.Module]:
    return train_reference("gpt", num_replicas=2, steps=2, batch_size=2, optimizer="adamw")


def test_compare_accepts_a_matching_run(reference) -> None:
    losses, model = reference
    compare(_fake_results(losses, model, 2, 4), losses, model, rtol=1e-5, atol=1e-5)


def test_compare_names_a_differing_parameter(reference) -> None:
    losses, model = reference
    results = _fake_results(losses, model, 2, 4)
    results[0]["merged"] = dict(results[0]["merged"])
    results[0]["merged"]["transformer.h.1.mlp.c_fc.weight"] = (
        results[0]["merged"]["transformer.h.1.mlp.c_fc.weight"] + 1e-3
    )
    with pytest.raises(
        AssertionError, match=r"(?s)1 of \d+ parameters differ.*transformer\.h\.1\.mlp\.c_fc\.weight"
    ):
        compare(results, losses, model, rtol=1e-5, atol=1e-5)


def test_compare_names_a_missing_parameter(reference) -> None:
    losses, model = reference
    results = _fake_results(losses, model, 1, 2)
    del results[0]["merged"]["transformer.wpe.weight"]
    with pytest.raises(AssertionError, match="lacks parameters.*transformer.wpe.weight"):
        compare(results, losses, model, rtol=1e-5, atol=1e-5)


def test_compare_checks_ranks_of_a_replica_agree(reference) -> None:
    losses, model = reference
    results = _fake_results(losses, model, 2, 4)
    results[3]["losses"] = [x + 1e-3 for x in losses]
    with pytest.raises(AssertionError, match="ranks 2 and 3 of replica 1 report different losses"):
        compare(results, losses, model, rtol=1e-5, atol=1e-5)


def test_compare_checks_mean_loss_per_step(reference) -> None:
    losses, model = reference
    results = _fake_results(losses, model, 1, 2)
    results[0]["losses"] = [losses[0], losses[1] + 0.01]
    results[1]["losses"] = [losses[0], losses[1] + 0.01]
    with pytest.raises(AssertionError, match="loss differs at step 1"):
        compare(results, losses, model, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", zoo.PARITY_MODELS)
def test_mean_of_replica_losses_is_the_loss_of_the_concatenated_batch(name: str) -> None:
    """What the harness relies on: every replica's loss is a mean over equally many items."""
    model, make_batch = zoo.build(name)
    model = copy.deepcopy(model)
    batches = [make_batch(_batch_seed(0, k), 2) for k in range(3)]
    with torch.no_grad():
        per_replica = [zoo.extract_loss(model(**b)).item() for b in batches]
        whole = zoo.extract_loss(model(**_cat_batches(batches))).item()
    assert sum(per_replica) / len(per_replica) == pytest.approx(whole, rel=1e-5)
