"""Robust gradient aggregation as the reducer uses it (`ComputeConfig.grad_aggregation`): the
coordinate-wise rules (robust.py) replace each bucket's collective; Zeno (zeno.py) scores the
replicas once all buckets hold their local gradients, then weighs the buckets before the usual
reduction; either way the step's dropped replicas are recorded (agg_stats.py).
See docs/faulty_replicas.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nnscaler.runtime.grads.agg_stats import AggregationStats
from nnscaler.runtime.grads.buckets import Bucket
from nnscaler.runtime.grads.robust import COORDINATE_MODES, SliceAggregator, window
from nnscaler.runtime.grads.zeno import Zeno

__all__ = ["RobustAggregation", "build_aggregation"]


@dataclass
class RobustAggregation:
    """The robust side of one reducer: exactly one of `coords` and `zeno` is set."""

    mode: str
    b: int
    stats: AggregationStats
    coords: SliceAggregator | None = None
    zeno: Zeno | None = None

    def before_launch(self, prepare: Callable[[Bucket], torch.Tensor], pending: Sequence[Bucket]) -> None:
        """Zeno, in `sync` before the buckets are launched (none was in backward): `prepare` them (the
        reducer's: fault drills apply), score this replica's gradient, agree on the kept replicas, and
        weigh (or zero) this rank's buckets."""
        if self.zeno is None or not pending:
            return
        for bucket in pending:
            prepare(bucket)
        keep = self.zeno.select(local_grads(pending), scale=pending[0].divisor)
        w = self.zeno.weight(keep)
        for bucket in pending:
            assert bucket.grads is not None
            if w == 0.0:
                bucket.grads.zero_()  # a dropped replica adds nothing, NaN and inf included
            else:
                bucket.grads.mul_(w)
        self.stats.last_scores = list(self.zeno.last_scores)
        self.stats.record([k for k, kept in enumerate(keep) if not kept])

    def end_round(self) -> None:
        """Coordinate-wise rules, at the end of `sync` (a collective): record the step's trimmed shares."""
        if self.coords is None:
            return
        counts = self.coords.take_counts()
        if counts is not None:
            outside, coords = counts
            lo, hi = window(self.coords.n, self.mode, self.b)
            self.stats.record_trimmed(outside.tolist(), coords, hi - lo)


def local_grads(buckets: Sequence[Bucket]) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
    """Each parameter with its view of a prepared bucket: its local gradient divided by the divisor."""
    return [(p, view) for bucket in buckets for p, view in zip(bucket.params, bucket.views)]


def build_aggregation(config: Any, group: dist.ProcessGroup, scatter: bool) -> RobustAggregation | None:
    """The robust aggregation `config` asks for over the data-parallel `group`; None for the mean (also
    any mode with `byzantine_b` 0: with no replica suspected every rule is the mean)."""
    mode = getattr(config, "grad_aggregation", "mean")
    b = getattr(config, "byzantine_b", 0)
    if mode == "mean" or b == 0:
        return None
    ranks = dist.get_process_group_ranks(group)
    stats = AggregationStats(mode, ranks, warn=dist.get_rank() == 0)
    if mode in COORDINATE_MODES:
        return RobustAggregation(mode, b, stats, coords=SliceAggregator(mode, b, group, scatter))
    if mode == "zeno":
        return RobustAggregation(mode, b, stats, zeno=Zeno(group, b, config.zeno_gamma, config.zeno_rho))
    raise ValueError(f"unknown grad_aggregation {mode!r}")
