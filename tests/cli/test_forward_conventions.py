"""The Trainer takes both forward conventions: the sample's keys as keyword arguments, or (nnScaler
0.8's) the whole sample as a one-parameter forward's argument; anything else is a ConfigError."""

from __future__ import annotations

import pytest
import torch

from nnscaler.cli import Trainer
from nnscaler.cli.forward_args import ForwardConvention, forward_convention
from nnscaler.errors import ConfigError
from tests.cli.common import gpt_args
from tests.cli.conventions import train_runs
from tests.dist_util import spawn

SAMPLE = {"idx": torch.zeros(2, 3), "targets": torch.zeros(2, 3)}


class Keyword(torch.nn.Module):
    def forward(self, idx, targets=None):
        return idx


class OneParam(torch.nn.Module):
    def forward(self, data):
        return data


class OneParamKwargs(torch.nn.Module):
    def forward(self, data, **extra):
        return data


class Neither(torch.nn.Module):
    def forward(self, tokens, labels):
        return tokens


def test_convention_is_decided_by_signature_and_keys():
    assert forward_convention(Keyword(), SAMPLE) == ForwardConvention()
    assert forward_convention(Keyword(), {"idx": 1}) == ForwardConvention()  # targets has a default
    whole = forward_convention(OneParam(), SAMPLE)
    assert whole.wrap_as == "data" and whole(SAMPLE) == {"data": SAMPLE}
    assert forward_convention(OneParam(), {"data": 1}) == ForwardConvention()  # its one key: keyword
    assert forward_convention(OneParam(), {"data": 1, "mask": 2}).wrap_as == "data"
    assert forward_convention(OneParam(), (1, 2)).wrap_as == "data"  # any sample, as nnScaler
    assert forward_convention(OneParamKwargs(), {"data": 1, "mask": 2}) == ForwardConvention()
    with pytest.raises(ConfigError) as err:
        forward_convention(Neither(), SAMPLE)
    msg = str(err.value)
    assert "Neither.forward(tokens, labels)" in msg and "['idx', 'targets']" in msg
    assert "['tokens', 'labels']" in msg
    with pytest.raises(ConfigError, match=r"a training sample is a tuple"):
        forward_convention(Neither(), (1, 2))


def test_trainer_refuses_a_forward_that_fits_neither(tmp_path):
    argv = gpt_args(
        tmp_path, "tp", 2, 2, run_mode="compile", **{"model.type": "tests.cli.conventions.TwoArgGPT"}
    )
    with pytest.raises(ConfigError, match=r"TwoArgGPT\.forward\(tokens.*\['idx', 'targets'\]"):
        Trainer(argv).run()
    assert not (tmp_path / "gen").exists()  # refused before anything was generated


def test_whole_sample_forward_trains_under_dp_tp_and_pp(tmp_path):
    """The same 4 steps (global batch 8) under each plan: the whole-sample model's losses equal the
    keyword model's."""
    common = {"checkpoint.no_save": None, "max_train_steps": 4}
    whole = {"model.type": "tests.cli.conventions.WholeSampleGPT"}
    runs = [
        gpt_args(tmp_path / "kw_tp", "tp", 2, 2, **common),
        gpt_args(tmp_path / "dp", "dp", 1, 2, grad_accumulation_steps=1, **common, **whole),
        gpt_args(tmp_path / "tp", "tp", 2, 2, **common, **whole),
        gpt_args(
            tmp_path / "pp",
            "pp",
            2,
            2,
            **common,
            **whole,
            **{"compute_config.pas_config.pipeline_nmicros": 2},
        ),
    ]
    results = spawn(train_runs, 2, tmp_path, runs)
    (keyword, _), *others = results[0]
    assert len(keyword) == 4 and keyword[-1] < keyword[0]
    for (losses, _), name in zip(others, ("dp", "tp", "pp")):
        torch.testing.assert_close(losses, keyword, rtol=1e-5, atol=1e-5, msg=f"whole-sample under {name}")
    assert [r[0] for r in results[1]] == [r[0] for r in results[0]]  # every rank reports the same losses
