"""A checkpoint saved under one plan and GPU count resumes under another and continues the loss curve:
tp on (2, 2) -> dp on (1, 2) (saving merged checkpoints) -> hybrid on (2, 4), then merged into one
file by the CLI verb."""

from __future__ import annotations

import torch

from nnscaler.cli import Trainer
from nnscaler.cli.train import main
from tests.cli.common import gpt_args
from tests.dist_util import spawn


def _train(rank: int, world: int, argv: list[str]) -> list[float]:
    trainer = Trainer(argv)
    trainer.run()
    return trainer.losses


def _argv(tmp, name, policy, plan, runtime, steps, **extra):
    # the same global batch (8 samples) under every plan: micro 2 x replicas x accumulation
    argv = gpt_args(
        tmp, policy, plan, runtime, max_train_steps=steps, global_batch_size=8, micro_batch_size=2, **extra
    )
    argv += ["--grad_accumulation_steps!", "--gen_savedir", str(tmp / f"gen_{name}")]
    argv[argv.index("--checkpoint.save_dir") + 1] = str(tmp / f"ckpt_{name}")
    return argv


def test_resume_under_other_plans_and_gpu_counts(tmp_path):
    reference = spawn(
        _train, 2, tmp_path, _argv(tmp_path, "tp", "tp", 2, 2, 7, **{"checkpoint.every_n_train_steps": 3})
    )[0]
    from_tp = {
        "checkpoint.resume_from": str(tmp_path / "ckpt_tp/0000-0003"),
        "checkpoint.save_type": "merged",
    }
    dp = spawn(_train, 2, tmp_path, _argv(tmp_path, "dp", "dp", 1, 2, 5, **from_tp))[0]
    assert sorted(p.name for p in (tmp_path / "ckpt_dp" / "last").iterdir()) == [
        "complete.json",
        "merged.ckpt",
    ]
    pipeline = {"compute_config.pas_config.pipeline_nmicros": 2, "compute_config.pas_config.pp_size": 2}
    hybrid = spawn(
        _train,
        4,
        tmp_path,
        _argv(
            tmp_path,
            "hy",
            "hybrid",
            2,
            4,
            7,
            **pipeline,
            **{"checkpoint.resume_from": str(tmp_path / "ckpt_dp/last")},
        ),
    )[0]
    print(reference, dp, hybrid)
    assert len(dp) == 2 and len(hybrid) == 2
    torch.testing.assert_close(dp + hybrid, reference[3:], rtol=2e-5, atol=2e-5)

    out = tmp_path / "merged.safetensors"
    assert main(["merge", str(tmp_path / "ckpt_hy" / "last"), str(out)]) == 0
    from safetensors.torch import load_file

    weights = load_file(str(out))
    assert weights["lm_head.weight"].shape == (64, 32)
    assert torch.equal(weights["lm_head.weight"], weights["transformer.wte.weight"])  # tied, each saved
    pt = tmp_path / "merged.ckpt"
    Trainer.merge_checkpoint(str(tmp_path / "ckpt_dp" / "last"), str(pt))
    merged = torch.load(pt, weights_only=False)
    assert merged["train_status"]["step"] == 5 and "param_names" in merged["optimizer"]["param_groups"][0]
