"""The trainer end to end on 2 gloo ranks: a YAML-driven tiny GPT trains under tp and under pp."""

from __future__ import annotations

import pytest

from nnscaler.cli import Trainer
from tests.cli.common import gpt_args
from tests.dist_util import spawn


def _train(rank: int, world: int, argv: list[str]) -> list[float]:
    trainer = Trainer(argv)
    trainer.run()
    return trainer.losses


@pytest.mark.parametrize(
    "policy, extra",
    [("tp", {}), ("pp", {"compute_config.pas_config.pipeline_nmicros": 2})],
)
def test_gpt_trains_on_two_ranks(tmp_path, policy, extra):
    argv = gpt_args(tmp_path, policy, 2, 2, **{"checkpoint.no_save": None, **extra})
    losses = spawn(_train, 2, tmp_path, argv)
    print(policy, [round(x, 4) for x in losses[0]])
    assert losses[0] == losses[1]  # every rank reports the same aggregated loss
    assert len(losses[0]) == 8
    assert losses[0][-1] < losses[0][0] - 0.5
    assert (tmp_path / "gen").is_dir()
