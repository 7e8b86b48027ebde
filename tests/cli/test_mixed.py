"""model.parallel_modules: only the GPT's Blocks are parallelized (tp on 2 ranks), the embeddings and
head stay plain; training matches the single-device run and resumes bitwise from a checkpoint."""

from __future__ import annotations

import pytest

from nnscaler.cli import Trainer
from tests.cli.common import gpt_args
from tests.dist_util import spawn

MIXED = {
    "model.parallel_modules.0.type": "examples.nanogpt.model.Block",
    "model.parallel_modules.0.forward_args_gen_fn": "tests.cli.common.block_inputs",
    "max_train_steps": 4,
}


def _train(rank: int, world: int, argv: list[str]) -> tuple[list[float], list[str]]:
    trainer = Trainer(argv)
    trainer.run()
    parallel = sorted(n for n, m in trainer.model.named_modules() if type(m).__name__.startswith("GenModel"))
    return trainer.losses, parallel


def test_parallel_sub_modules_train_and_resume(tmp_path):
    (losses, parallel), _ = spawn(
        _train, 2, tmp_path, gpt_args(tmp_path, "tp", 2, 2, **MIXED, **{"checkpoint.every_n_train_steps": 2})
    )
    assert parallel == ["transformer.h.0", "transformer.h.1"], parallel
    single = Trainer(
        gpt_args(tmp_path / "single", "dp", 1, 1, max_train_steps=4, **{"checkpoint.no_save": None})
    )
    single.run()
    assert losses == pytest.approx(single.losses, rel=1e-5)

    argv = gpt_args(
        tmp_path, "tp", 2, 2, **MIXED, **{"checkpoint.resume_from": str(tmp_path / "ckpt" / "0000-0002")}
    )
    argv[argv.index("--checkpoint.save_dir") + 1] = str(tmp_path / "ckpt2")
    (resumed, _), _ = spawn(_train, 2, tmp_path, argv)
    assert resumed == losses[2:]
