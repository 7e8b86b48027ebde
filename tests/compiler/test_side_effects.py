"""Python side effects that tracing drops (`self.calls += 1` in forward) are named in one warning at
compile time; libraries' own bookkeeping in forward (transformers) raises none."""

from __future__ import annotations

import functools
import warnings

import torch
from torch import nn

from nnscaler.graph.capture import capture
from nnscaler.graph.capture.side_effects import SideEffectWarning


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.scale = 2.0  # read, never written: not a side effect

    def forward(self, x):
        return self.fc(x) * self.scale


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.calls = 0
        self.cache = None  # a library-style slot that becomes an object: not a plain value

    @functools.cached_property
    def factor(self) -> float:  # stored on first read: derived, not a side effect
        return 0.5

    def forward(self, x):
        self.calls += 1
        self.cache = object()
        return self.inner(x).sum() * self.factor


def _side_effect_warnings(module: nn.Module, inputs: dict) -> list[str]:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        capture(module, inputs)
    return [str(w.message) for w in record if issubclass(w.category, SideEffectWarning)]


def test_counter_in_forward_gives_one_warning_naming_it():
    module = Counting()
    found = _side_effect_warnings(module, {"x": torch.randn(3, 4)})
    assert len(found) == 1, found
    assert "`calls` (0 -> 1)" in found[0] and "generated code will never change them" in found[0]
    assert "scale" not in found[0] and "cache" not in found[0] and "factor" not in found[0]
    assert not module._forward_hooks  # the watch is gone after the capture


def test_nested_attribute_and_list_in_place_are_named():
    class Recording(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()
            self.seen: list[int] = []

        def forward(self, x):
            self.seen.append(4)
            self.inner.last = "run"
            return self.inner(x).sum()

    (found,) = _side_effect_warnings(Recording(), {"x": torch.randn(3, 4)})
    assert "`seen` ([] -> [4])" in found and "`inner.last` (<not set> -> 'run')" in found


def test_tiny_llama_traces_without_side_effect_warnings():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        use_cache=False,  # a cache object in the output cannot be exported
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).train()
    ids = torch.randint(0, 64, (2, 8))
    assert _side_effect_warnings(model, {"input_ids": ids, "labels": ids.clone()}) == []
