"""Progress of a run on rank 0: a tqdm bar (loss, samples/s, ETA) on an interactive terminal, else
a summary line every `log_progress_every_n_train_steps` steps."""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["Progress"]


class Progress:
    """Reports optimizer steps `initial`..`total`; silent where `active` is False (ranks other than 0)."""

    def __init__(self, args: Any, total: int, active: bool, *, initial: int = 0, stream: Any = None):
        self.total, self.active, self.stream = total, active, stream or sys.stdout
        self.every = args.log_progress_every_n_train_steps
        self.start, self.initial = time.monotonic(), initial
        self.bar = None
        if active and args.enable_progress_bar and self.stream.isatty():
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", file=self.stream)

    def update(self, step: int, loss: float, samples_per_sec: float) -> None:
        if not self.active:
            return
        if self.bar is not None:
            self.bar.update(step - self.bar.n)
            self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{samples_per_sec:.1f}")
            return
        if self.every and (step % self.every == 0 or step == self.total):
            elapsed = time.monotonic() - self.start
            done = max(step - self.initial, 1)
            eta = elapsed / done * max(self.total - step, 0)
            print(
                f"step {step}/{self.total}  loss {loss:.4f}  samples/s {samples_per_sec:.1f}  "
                f"elapsed {elapsed:.0f}s  eta {eta:.0f}s",
                file=self.stream,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
