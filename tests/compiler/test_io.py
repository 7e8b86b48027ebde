"""Inputs and outputs as users write them: keyword and non-tensor arguments, nested dicts and lists,
ModelOutput returns; and ops without annotations kept whole with one warning."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from nnscaler import ComputeConfig, parallelize
from nnscaler.parallel.unannotated import UnannotatedOpWarning
from tests import zoo


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, batch, scale: float = 1.0):
        h = self.lin(batch["x"]) * scale + batch["pair"][0]
        loss = (h - batch["pair"][1]).pow(2).mean()
        return {"loss": loss, "parts": [h.sum(), {"h": h}]}


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(2, 4, generator=g),
        "pair": [torch.randn(2, 4, generator=g), torch.randn(2, 4, generator=g)],
    }


def test_nested_inputs_and_outputs_round_trip(tmp_path):
    torch.manual_seed(0)
    model = Nested()
    pm = parallelize(
        model, {"batch": _batch(), "scale": 2.0}, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path
    )
    batch = _batch(1)
    got, want = pm(batch, 2.0), model(batch, 2.0)
    assert set(got) == {"loss", "parts"} and isinstance(got["parts"][1], dict)
    torch.testing.assert_close(got["loss"], want["loss"])
    torch.testing.assert_close(got["parts"][1]["h"], want["parts"][1]["h"])
    with pytest.raises(ValueError, match="non-tensor input .* is 3.0 but the code was generated with 2.0"):
        pm(batch, 3.0)
    with pytest.raises(TypeError, match="same nesting"):
        pm({"x": batch["x"], "pair": batch["pair"][:1]}, 2.0)


def test_model_output_type_is_kept(tmp_path):
    model, make_batch = zoo.build("llama")
    pm = parallelize(model, make_batch(0, 2), "dp", ComputeConfig(1, 1), gen_savedir=tmp_path)
    out = pm(**make_batch(1, 2))
    assert type(out).__name__ == "CausalLMOutputWithPast"
    assert set(out.keys()) == {"loss", "logits"}
    # forward arguments left at their defaults when traced stay in the signature, and are checked
    batch = make_batch(1, 2)
    torch.testing.assert_close(pm(**batch, attention_mask=None).loss, out.loss)
    with pytest.raises(ValueError, match="attention_mask=.* was not part of the dummy inputs"):
        pm(**batch, attention_mask=torch.ones(2, 16, dtype=torch.long))


class Unannotated(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return torch.special.i0(self.lin(x)).sum()  # aten.special_i0 has no annotation


def test_unannotated_op_is_kept_whole_with_one_warning(tmp_path):
    torch.manual_seed(0)
    model = Unannotated()
    x = torch.randn(4, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = parallelize(model, {"x": x}, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path)
    ours = [w for w in caught if issubclass(w.category, UnannotatedOpWarning)]
    assert len(ours) == 1
    assert "i0" in str(ours[0].message) and "test_io.py" in str(ours[0].message)
    torch.testing.assert_close(pm(x), model(x))
