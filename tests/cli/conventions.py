"""Models and runners for the Trainer-usability tests: nanoGPT written for nnScaler 0.8's convention
(forward takes the whole sample), and a runner that trains several configs in one process group and
returns each run's losses and what it printed."""

from __future__ import annotations

import contextlib
import io

import torch

from examples.nanogpt.model import GPT


class WholeSampleGPT(GPT):
    """nanoGPT whose forward takes the collated sample as its one argument (nnScaler 0.8's Trainer)."""

    def forward(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        return super().forward(data["idx"], data["targets"])


class TwoArgGPT(GPT):
    """A forward that takes neither the sample's keys nor the whole sample."""

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens, labels)


def train_runs(rank: int, world: int, runs: list[list[str]]) -> list[tuple[list[float], str]]:
    """Train each argv in turn on this rank; (losses, stdout) of each."""
    from nnscaler.cli import Trainer

    out = []
    for argv in runs:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            trainer = Trainer(argv)
            trainer.run()
        out.append((trainer.losses, buf.getvalue()))
    return out


def run_expecting_error(rank: int, world: int, argv: list[str]) -> str:
    """Run the Trainer; the text of the error it raises ('' when it trains through)."""
    from nnscaler.cli import Trainer

    try:
        Trainer(argv).run()
    except Exception as err:  # noqa: BLE001 - the test reads the message
        return f"{type(err).__name__}: {err}"
    return ""
