"""The model zoo builds the same model and batches from the same seed, and its models train."""

from __future__ import annotations

import pytest
import torch

from tests import zoo


@pytest.mark.parametrize("name", zoo.PARITY_MODELS)
def test_same_seed_same_model_and_batch(name: str) -> None:
    m1, make_batch = zoo.build(name, seed=3)
    m2, _ = zoo.build(name, seed=3)
    for (k1, v1), (k2, v2) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert k1 == k2 and torch.equal(v1, v2), k1
    b1, b2 = make_batch(7, 2), make_batch(7, 2)
    assert b1.keys() == b2.keys()
    for key in b1:
        assert torch.equal(b1[key], b2[key]), key
    assert not torch.equal(next(iter(make_batch(8, 2).values())), next(iter(b1.values())))


@pytest.mark.parametrize("name", zoo.PARITY_MODELS)
def test_model_trains_in_fp32(name: str) -> None:
    model, make_batch = zoo.build(name)
    batch = make_batch(0, 2)
    tensors = [v for v in batch.values() if isinstance(v, torch.Tensor)]
    # torch.export merges inputs that are the same tensor object, so they must not be
    assert len({id(t) for t in tensors}) == len(tensors)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    loss = zoo.extract_loss(model(**batch))
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_gpt_ties_embedding_and_head() -> None:
    model, _ = zoo.build("gpt")
    assert model.lm_head.weight is model.transformer.wte.weight


def test_meta_llama3_8b_has_no_storage() -> None:
    model, make_batch = zoo.build("meta")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert 8.0e9 < sum(p.numel() for p in model.parameters()) < 8.1e9
    assert make_batch(0, 1)["input_ids"].shape == (1, 1024)


@pytest.mark.parametrize("name", zoo.PARITY_MODELS)
def test_zoo_models_export(name: str) -> None:
    """Capture (DESIGN.md §2.1) starts from torch.export; the zoo must stay exportable."""
    model, make_batch = zoo.build(name)
    exported = torch.export.export(model, (), kwargs=make_batch(0, 2), strict=False)
    # the exported program computes the model: same loss on a batch it was not traced with
    batch = make_batch(1, 2)
    with torch.no_grad():
        expected = zoo.extract_loss(model(**batch))
        got = zoo.extract_loss(exported.module()(**batch))
    torch.testing.assert_close(got, expected)
    # and takes the parameters as inputs, under their state-dict names
    assert set(exported.graph_signature.parameters) == {
        n for n, _ in model.named_parameters(remove_duplicate=False)
    }
