"""A tiny mixture-of-experts LM shaped for the Trainer: tests/models_moe.py's hand-written model (two
MoE blocks of 4 experts, top-2, a shared expert) with the Trainer's sample keys (`idx`, `targets`)
as forward arguments, trained on tests.cli.common.CountingTokens."""

from __future__ import annotations

import torch

from tests.models_moe import VOCAB, HandModel

__all__ = ["MoELM", "VOCAB"]


class MoELM(HandModel):
    """forward(idx, targets) -> the mean cross entropy (no router losses: the batch splits exactly)."""

    def __init__(self) -> None:
        super().__init__(aux=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(idx, targets)
