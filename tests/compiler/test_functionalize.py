"""Writes into slices of activations reach the compiled program (torch's functionalization).

Each model writes into a view of a tensor it computed, the way real models do (T5's
`_shift_right`, BART's `shift_tokens_right`, DeepSeek's K/V filled by `copy_` into slices of
`new_empty`); the compiled single-device module must compute what eager computes, forward and
backward, in train and in eval mode, at the traced shape and at another batch and length.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import nnscaler
from nnscaler.graph.capture import capture
from nnscaler.graph.capture.functionalize import writes_into_activations
from nnscaler.graph.capture.modes import ModeWarning


class ShiftRight(nn.Module):
    """Decoder input built like T5's `_shift_right`: a new tensor filled through two slice writes."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.out = nn.Linear(8, 16)

    def forward(self, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        shifted = ids.new_zeros(ids.shape)
        shifted[..., 1:] = ids[..., :-1].clone()
        shifted[..., 0] = 3
        shifted.masked_fill_(shifted == 5, 1)
        logits = self.out(self.emb(shifted))
        return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


class FillSlices(nn.Module):
    """An activation assembled by `copy_` into slices of `new_empty`, then updated in place."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)
        self.head = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_empty(*x.shape[:-1], 8)
        h[..., :4].copy_(self.a(x))
        h[..., 4:].copy_(torch.tanh(self.b(x)))
        h[:, 0] *= 2.0  # a write into a row of the assembled tensor
        h.add_(1.0)
        return self.head(h).square().mean()


class NormAndWrite(nn.Module):
    """Batch norm (running statistics updated in place) and dropout beside a slice write: all
    three survive, and the program still follows train()/eval()."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lin(x)
        h[:, :2] = 0.0
        return self.drop(self.bn(h)).sum(dim=-1).pow(2).mean()


class StateThroughSlices(nn.Module):
    """A buffer and an input written through slices: updates of state stay in place, at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)
        self.register_buffer("ema", torch.zeros(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x[:, 0] = 1.0  # the caller's tensor changes, as in eager
        h = self.lin(x)
        self.ema[:3] = 0.9 * self.ema[:3] + 0.1 * h.mean(0)[:3].detach()
        return (h * x).sum(dim=-1).pow(2).mean() + self.ema.sum()


def _ids(seed: int, batch: int, length: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "ids": torch.randint(0, 16, (batch, length), generator=g),
        "target": torch.randint(0, 16, (batch, length), generator=g),
    }


def _x(width: int):
    def make(seed: int, batch: int, length: int) -> dict:
        g = torch.Generator().manual_seed(seed)
        return {
            "x": torch.randn(batch, length, width, generator=g)
            if width == 8
            else torch.randn(batch * length, width, generator=g)
        }

    return make


CASES = {
    "shift_right": (ShiftRight, _ids),
    "fill_slices": (FillSlices, _x(8)),
    "norm_and_write": (NormAndWrite, _x(6)),
    "state_through_slices": (StateThroughSlices, _x(6)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_captured_program_has_no_write_into_an_activation(name):
    build, make = CASES[name]
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ModeWarning)  # the program still follows train()/eval()
        graph = capture(build(), make(0, 2, 5))
    written = [
        n
        for n in graph.nodes
        if n.op.split(".")[1].endswith("_") and graph.values[n.args[0].name].kind == "activation"
    ]
    assert written == []
    ops = {n.op for n in graph.nodes}
    assert ops & {"aten.slice_scatter.default", "aten.select_scatter.default"}, ops


def test_programs_without_writes_into_activations_are_left_to_the_fast_path():
    ep = torch.export.export(
        nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), (torch.randn(3, 4),), strict=False
    )
    assert not writes_into_activations(ep)  # the only writes are batch norm's, into its buffers
    ep = torch.export.export(ShiftRight(), (), _ids(0, 2, 5), strict=False)
    assert writes_into_activations(ep)


@pytest.mark.parametrize("name", sorted(CASES))
def test_compiled_module_matches_eager(name, tmp_path):
    build, make = CASES[name]
    torch.manual_seed(0)
    eager = build()
    torch.manual_seed(0)
    compiled = nnscaler.parallelize(
        build(), make(0, 2, 5), "dp", nnscaler.ComputeConfig(1, 1), gen_savedir=tmp_path
    )
    for mode in ("train", "eval"):
        eager.train(mode == "train")
        compiled.train(mode == "train")
        for seed, batch, length in ((1, 2, 5), (2, 3, 7)):  # the traced shape and another one
            data, twin = make(seed, batch, length), make(seed, batch, length)
            torch.manual_seed(seed)  # the same dropout mask on both sides
            want = eager(**data)
            torch.manual_seed(seed)
            got = compiled(**twin)
            for key in data:  # inputs written in place are written alike
                torch.testing.assert_close(twin[key], data[key])
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=f"{mode} {batch}x{length}")
            if mode == "train":
                eager.zero_grad()
                compiled.zero_grad()
                want.backward()
                got.backward()
                grads = {n: p.grad for n, p in eager.named_parameters()}
                names = _full_names(compiled)
                for local, p in compiled.named_parameters():
                    torch.testing.assert_close(p.grad, grads[names[local]], rtol=1e-5, atol=1e-6)
    for name_, buf in eager.named_buffers():  # batch norm's statistics moved alike in both
        torch.testing.assert_close(compiled.state_dict()[name_], buf)


def _full_names(compiled) -> dict[str, str]:
    """Local parameter name -> the original module's parameter name."""
    return {
        local: spec[0] if isinstance(spec, tuple) else spec for local, spec in compiled.dist_param_map.items()
    }
