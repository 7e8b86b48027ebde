"""The reuse fingerprint leaves library bookkeeping out quietly (transformers 5's `_weight_conversions`,
set by `from_pretrained`), while an unrecordable attribute a user set is still named in an
AttributeWarning (nnscaler.parallel.attributes, the rule in its docstring)."""

from __future__ import annotations

import warnings

import pytest
import torch

from nnscaler import ComputeConfig, parallelize
from nnscaler.parallel import fingerprint as fp_mod
from nnscaler.parallel.attributes import AttributeWarning

VOCAB = 64


class Opaque:
    """An object of the user's own class, with state the fingerprint cannot read."""

    def __init__(self) -> None:
        self.table = object()


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """A tiny Mixtral saved and loaded back (local files, no download): loading converts its expert
    weights, so transformers records the conversions in `model._weight_conversions`."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,
        sliding_window=None,
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("mixtral")
    MixtralForCausalLM(config).save_pretrained(path)
    return lambda: MixtralForCausalLM.from_pretrained(path)


def _args() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(0, VOCAB, (2, 8), generator=g),
        "labels": torch.randint(0, VOCAB, (2, 8), generator=g),
    }


def _attributes(model: torch.nn.Module) -> dict[str, str]:
    return fp_mod.fingerprint(model, _args(), "dp", ComputeConfig(1, 1), "v")["attributes"]


def test_loaded_transformers_model_parallelizes_without_attribute_warning(loaded, tmp_path):
    model = loaded()
    assert model._weight_conversions, "the loaded model should carry transformers' conversion records"
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        parallelize(model, _args(), "dp", ComputeConfig(1, 1), gen_savedir=tmp_path, load_module=False)
    mine = [str(w.message) for w in record if issubclass(w.category, AttributeWarning)]
    assert mine == []
    values = _attributes(model)
    assert not any("_weight_conversions" in k for k in values)  # left out, as before
    assert values["config.hidden_size"] == "16"  # what forward computes with is still recorded


@pytest.mark.parametrize("name", ["helper", "_helper"])
def test_user_set_attribute_still_warns(loaded, name):
    model = loaded()
    setattr(model, name, Opaque())  # public or private: an object of the user's own class
    with pytest.warns(AttributeWarning) as record:
        _attributes(model)
    mine = [str(w.message) for w in record if issubclass(w.category, AttributeWarning)]
    assert len(mine) == 1 and f"`{name}` ({__name__}.Opaque)" in mine[0], mine
    assert "_weight_conversions" not in mine[0]


def test_torch_object_in_a_private_slot_of_a_library_model_warns(loaded):
    model = loaded()
    model.model._gen = torch.Generator()  # torch's, not transformers' own records
    with pytest.warns(AttributeWarning, match=r"`model\._gen` \(torch\._C\.Generator\)"):
        _attributes(model)
