"""A dummy-input value `inspect.Parameter.empty` means "no value", as nnScaler 0.8 reads it: its
huggingface_nlp example builds the dummy dict from forward's signature (`{k: p.default ...}`), which
gives `kwargs: Parameter.empty` for a transformers model's **kwargs (issue 43)."""

from __future__ import annotations

import inspect

import pytest
import torch

from nnscaler import ComputeConfig, parallelize
from nnscaler.errors import TraceError


class KwargsModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, input_ids, **kwargs):
        return self.lin(input_ids).sum()


def test_signature_built_dummy_inputs_trace(tmp_path):
    torch.manual_seed(0)
    model, x = KwargsModel(), torch.randn(2, 4)
    sig = inspect.signature(model.forward).parameters
    dummy = {k: x if k == "input_ids" else p.default for k, p in sig.items()}
    assert dummy["kwargs"] is inspect.Parameter.empty
    pm = parallelize(model, dummy, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path, reuse="override")
    torch.testing.assert_close(pm(input_ids=x), model(input_ids=x))
    # and called with that same dict, as the example calls it: the generated forward has no **kwargs
    torch.testing.assert_close(pm(**{**dummy, "input_ids": x}), model(input_ids=x))


def test_a_required_argument_given_as_empty_is_missing(tmp_path):
    dummy = {"input_ids": inspect.Parameter.empty}
    with pytest.raises(TraceError, match="missing forward argument 'input_ids'"):
        parallelize(KwargsModel(), dummy, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path, reuse="override")
