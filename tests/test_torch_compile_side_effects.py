"""`ComputeConfig.torch_compile` and forward's Python side effects (`self.calls += 1`, output scaled by
it): the generated code keeps only the trace's tensor operations, so compiled it would return 1x on
every call where the model (eager, or under torch.compile itself) gives 1x, 2x, 3x. parallelize
refuses instead, naming the attribute, the source line and the fix (graph/capture/side_effects.py says
why refused rather than run eagerly). Eager generated code keeps its SideEffectWarning.

Before the fix test_compiled_side_effect_is_refused_naming_attribute_and_line and
test_nested_and_in_place_changes_are_named_with_their_lines failed (parallelize accepted the models,
with a warning, and the three calls returned 1x each), as did test_source_line_of_an_unknown_writer
(new helper); the eager, disabled and buffer-counter tests passed already."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

import nnscaler
from nnscaler import ComputeConfig
from nnscaler.errors import ConfigError
from nnscaler.graph.capture.side_effects import SideEffectWarning, source_line

COMPILE = {"backend": "aot_eager"}


class Counting(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.fc(x).sum() * self.calls


class CountingBuffer(nn.Module):
    """The fix the refusal names: the counter is a buffer updated with tensor operations."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.fc(x).sum() * self.calls


class Inner(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class Recording(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()
        self.seen: list[int] = []

    def forward(self, x):
        self.seen.append(4)
        self.inner.last = "run"
        return self.inner(x).sum()


def _parallel(model: nn.Module, tmp_path, torch_compile) -> nn.Module:
    cfg = ComputeConfig(1, 1, torch_compile=torch_compile)
    return nnscaler.parallelize(model, {"x": torch.randn(3, 4)}, "dp", cfg, gen_savedir=tmp_path)


def _three_calls(module: nn.Module, x: torch.Tensor) -> list[float]:
    with torch.no_grad():
        return [float(module(x)) for _ in range(3)]


def test_compiled_side_effect_is_refused_naming_attribute_and_line(tmp_path):
    torch.manual_seed(0)
    model = Counting()
    with warnings.catch_warnings():
        warnings.simplefilter("error", SideEffectWarning)  # refused, not (only) warned about
        with pytest.raises(ConfigError) as info:
            _parallel(model, tmp_path, COMPILE)
    message = str(info.value)
    assert message.startswith("ComputeConfig.torch_compile: forward changes model attribute(s) `calls`"), (
        message
    )
    line = next(i for i, text in enumerate(open(__file__), 1) if text.strip() == "self.calls += 1")
    assert f"test_torch_compile_side_effects.py:{line} `self.calls += 1`" in message, message
    assert "buffer updated in place" in message and "torch_compile=False" in message, message
    assert not list(tmp_path.rglob("gencode0.py")), "no code is generated for a refused model"


def test_eager_generated_code_keeps_the_warning(tmp_path):
    torch.manual_seed(0)
    with pytest.warns(SideEffectWarning, match=r"`calls` \(0 -> 1\)"):
        pm = _parallel(Counting(), tmp_path, False)
    assert len(set(_three_calls(pm, torch.randn(3, 4)))) == 1  # what the warning says: the trace's value


def test_disabled_compile_is_eager(tmp_path):
    with pytest.warns(SideEffectWarning):
        _parallel(Counting(), tmp_path, {"backend": "aot_eager", "disable": True})


def test_buffer_counter_matches_eager_on_calls_1_2_3(tmp_path):
    torch.manual_seed(0)
    model = CountingBuffer()
    reference = CountingBuffer()
    reference.load_state_dict(model.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error", SideEffectWarning)
        pm = _parallel(model, tmp_path, COMPILE)
    x = torch.randn(3, 4)
    want = _three_calls(reference, x)
    assert want[1] == pytest.approx(2 * want[0]) and want[2] == pytest.approx(3 * want[0])
    assert _three_calls(pm, x) == pytest.approx(want, rel=1e-6)


def test_nested_and_in_place_changes_are_named_with_their_lines(tmp_path):
    with pytest.raises(ConfigError) as info:
        _parallel(Recording(), tmp_path, COMPILE)
    message = str(info.value)
    for code in ("self.seen.append(4)", 'self.inner.last = "run"'):
        line = next(i for i, text in enumerate(open(__file__), 1) if text.strip() == code)
        assert re.search(rf"at test_torch_compile_side_effects\.py:{line} `{re.escape(code)}`", message), (
            code,
            message,
        )


def test_source_line_of_an_unknown_writer():
    model = Recording()
    assert source_line(model, "inner.nothing") == "an unknown line"
    assert source_line(model, "seen").endswith("`self.seen.append(4)`")
