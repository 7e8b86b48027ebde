"""Bucket-size autotuning over the first training steps (Horovod's autotune, reduced to the knob that
matters most here): each candidate bucket size runs a few steps, the time from the first gradient of
backward to the end of the gradient sync is measured, the slowest rank's median counts (every rank
must choose alike), and the fastest candidate is kept for the rest of the run.

`ComputeConfig(reducer_bucket_autotune=True)`; not with ZeRO (its buckets are the optimizer's slices,
fixed once the optimizer is built). The first step of each candidate is a warm-up and not counted.
Timing needs the device to finish: on CUDA each measured step synchronises once, during tuning only.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["BucketAutotuner", "DEFAULT_CANDIDATES_MB"]

DEFAULT_CANDIDATES_MB = (1.0, 4.0, 16.0, 25.0, 64.0)
"""Bucket sizes tried, in MB (25: torch DDP's default)."""

log = logging.getLogger("nnscaler.runtime.grads.autotune")


@dataclass
class BucketAutotuner:
    """Tries `candidates` (MB) for `steps_per_candidate` steps each, then keeps the fastest."""

    candidates: tuple[float, ...] = DEFAULT_CANDIDATES_MB
    steps_per_candidate: int = 3
    index: int = 0
    """The candidate being tried."""
    times: list[list[float]] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    """Per candidate tried: the slowest rank's median seconds."""
    chosen: float | None = None
    """The bucket size kept, once every candidate ran."""

    def __post_init__(self) -> None:
        if not self.candidates or self.steps_per_candidate < 2:
            raise ValueError(
                "BucketAutotuner needs candidates and at least 2 steps per candidate (1 warms up)"
            )
        self.times = [[] for _ in self.candidates]

    @property
    def current_mb(self) -> float:
        """The bucket size the reducer should have now."""
        return self.chosen if self.chosen is not None else self.candidates[self.index]

    @property
    def tuning(self) -> bool:
        return self.chosen is None

    def record(self, seconds: float, group: dist.ProcessGroup | None) -> bool:
        """One step took `seconds` with the current size. Returns True when a candidate's steps are done
        (the reducer is then rebuilt with `current_mb`: the next candidate, or the one chosen). Collective over `group` (the data-parallel group) when a candidate's steps are done:
        every rank of it records at the same steps."""
        if not self.tuning:
            return False
        mine = self.times[self.index]
        mine.append(seconds)
        if len(mine) < self.steps_per_candidate:
            return False
        score = torch.tensor([statistics.median(mine[1:])], dtype=torch.float64)
        if group is not None:
            dist.all_reduce(score, op=dist.ReduceOp.MAX, group=group)  # CPU tensor: gloo twin group
        self.scores.append(float(score))
        self.index += 1
        if self.index == len(self.candidates):
            best = min(range(len(self.scores)), key=self.scores.__getitem__)
            self.chosen = self.candidates[best]
            log.info(
                "bucket autotune: %s MB (median step seconds per candidate: %s)",
                self.chosen,
                dict(zip(self.candidates, (round(s, 5) for s in self.scores))),
            )
        return True
