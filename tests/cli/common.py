"""Data and helpers for the trainer tests: a learnable synthetic token dataset for the nanoGPT model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CONFIGS = Path(__file__).with_name("configs")


class CountingTokens(torch.utils.data.Dataset):
    """Sequences that count upward from a random start modulo `vocab`: sample i is fixed by (seed, i)."""

    def __init__(self, size: int, vocab: int = 64, block: int = 16, seed: int = 0):
        self.size, self.vocab, self.block, self.seed = size, vocab, block, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed * 100_003 + i)
        start = torch.randint(0, self.vocab, (1,), generator=g)
        seq = (start + torch.arange(self.block + 1)) % self.vocab
        return {"idx": seq[:-1], "targets": seq[1:]}


def gpt_args(tmp: Path, policy: str = "tp", plan: int = 2, runtime: int = 2, **overrides: Any) -> list[str]:
    """Command-line arguments for the tiny GPT config, with run directories under `tmp`."""
    argv = [
        "-f",
        str(CONFIGS / "gpt.yaml"),
        "--pas_policy",
        policy,
        "--compute_config.plan_ngpus",
        str(plan),
        "--compute_config.runtime_ngpus",
        str(runtime),
        "--gen_savedir",
        str(tmp / "gen"),
        "--checkpoint.save_dir",
        str(tmp / "ckpt"),
    ]
    for key, value in overrides.items():
        argv += [f"--{key}"] if value is None else [f"--{key}", str(value)]
    return argv


def block_inputs(trainer_args: Any) -> dict[str, torch.Tensor]:
    """Dummy forward arguments of one nanoGPT Block: the residual stream of one micro-batch."""
    cfg = trainer_args.model.args["config"]
    return {"x": torch.randn(trainer_args.micro_batch_size, cfg["block_size"], cfg["n_embd"])}
