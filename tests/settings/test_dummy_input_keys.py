"""Dummy-input keys a forward's `**kwargs` takes (issue 41): each either reaches the model through the
generated forward at call time, or parallelize refuses it before tracing, naming the key and the
forward's signature. Before, a key named `kwargs` was dropped from the generated forward, whose first
call then raised "unexpected keyword argument 'kwargs'"; keys such as 'pytree' or 'foo-bar' failed as
a code generation bug."""

from __future__ import annotations

import pytest
import torch

from nnscaler import ComputeConfig, parallelize
from nnscaler.errors import TraceError


class KwargsModel(torch.nn.Module):
    """A transformers-5-style forward: named inputs, the rest through **kwargs; reads `kwargs[READ]`."""

    def __init__(self, read: str | None) -> None:
        super().__init__()
        self.read = read
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, input_ids, **kwargs):
        y = self.lin(input_ids)
        if self.read is not None:
            y = y * kwargs[self.read]
        return y.sum()


def _parallel(model: torch.nn.Module, batch: dict, tmp_path) -> torch.nn.Module:
    return parallelize(model, batch, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path, reuse="override")


@pytest.mark.parametrize("key", ["kwargs", "scale"])
def test_a_key_the_model_reads_from_kwargs_reaches_it(key, tmp_path):
    torch.manual_seed(0)
    model, x = KwargsModel(read=key), torch.randn(2, 4)
    pm = _parallel(model, {"input_ids": x, key: torch.tensor(3.0)}, tmp_path)
    for value in (3.0, -2.0):  # the value given at call time, not the traced one
        batch = {"input_ids": x, key: torch.tensor(value)}
        torch.testing.assert_close(pm(**batch), model(**batch))
    assert not torch.allclose(
        pm(input_ids=x, **{key: torch.tensor(3.0)}), pm(input_ids=x, **{key: torch.tensor(-2.0)})
    )


@pytest.mark.parametrize("key", ["kwargs", "args", "foo"])
def test_a_key_the_model_ignores_is_taken_at_call_time(key, tmp_path):
    torch.manual_seed(0)
    model, x = KwargsModel(read=None), torch.randn(2, 4)
    batch = {"input_ids": x, key: torch.tensor(1.0)}
    pm = _parallel(model, batch, tmp_path)
    torch.testing.assert_close(pm(**batch), model(**batch))


@pytest.mark.parametrize(
    "key, why",
    [
        ("foo-bar", "is not a Python identifier"),
        ("class", "is not a Python identifier"),
        ("self", "is the generated module's `self`"),
        ("pytree", "is a name the generated code uses itself"),
        ("_IN_SPEC", "is a name the generated code uses itself"),
    ],
)
def test_a_key_the_generated_forward_cannot_take_is_refused_before_tracing(key, why, tmp_path, monkeypatch):
    def no_trace(*args, **kwargs):
        raise AssertionError("traced before checking the dummy inputs' keys")

    monkeypatch.setattr("nnscaler.parallel.compile.capture", no_trace)
    batch = {"input_ids": torch.randn(2, 4), key: torch.tensor(1.0)}
    with pytest.raises(TraceError) as info:
        _parallel(KwargsModel(read=None), batch, tmp_path)
    message = str(info.value)
    assert f"key {key!r} {why}" in message, message
    assert "KwargsModel.forward(input_ids, **kwargs)" in message and "rename the key" in message, message
