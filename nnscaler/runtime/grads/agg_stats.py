"""Which data-parallel replicas robust gradient aggregation dropped or down-weighted, step by step.

Zeno drops whole replicas: those are the dropped ones. The coordinate-wise rules drop values, not
replicas: a replica counts as down-weighted in a step when more of its coordinates were trimmed away
than halfway between what an honest replica expects (`1 - kept / n`: the window's share of positions)
and all of them. A replica dropped in more than half of the steps (after `WARN_AFTER` steps) is named
in one warning, on global rank 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

__all__ = ["AggregationStats", "WARN_AFTER"]

logger = logging.getLogger("nnscaler.runtime.grads")

WARN_AFTER = 10
"""Steps recorded before a replica dropped in most of them is warned about."""


@dataclass
class AggregationStats:
    """Per-step records of one data-parallel group's robust aggregation (the reducer's `stats`)."""

    mode: str
    ranks: list[int]
    """Global rank of each replica in the group (replica k is the group's k-th rank)."""
    warn: bool = False
    """Log the warning here (global rank 0 only, so a run warns once)."""
    steps: int = 0
    dropped: list[int] = field(default_factory=list)
    """Per replica: steps in which it was dropped or down-weighted."""
    last_dropped: list[int] = field(default_factory=list)
    """Replicas (group indices) dropped in the last recorded step."""
    last_scores: list[float] | None = None
    """Zeno: the replicas' scores in the last step (higher is better)."""
    last_trimmed: list[float] | None = None
    """Coordinate-wise rules: per replica, the share of its coordinates trimmed away in the last step."""
    _warned: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self.dropped = [0] * len(self.ranks)

    def record(self, dropped: list[int]) -> None:
        """One step: the replicas (group indices) dropped in it."""
        self.steps += 1
        self.last_dropped = list(dropped)
        for k in dropped:
            self.dropped[k] += 1
        if not self.warn or self.steps < WARN_AFTER:
            return
        for k, count in enumerate(self.dropped):
            if count * 2 > self.steps and k not in self._warned:
                self._warned.add(k)
                logger.warning(
                    "grad_aggregation=%r dropped the gradient of data-parallel replica %d (rank %d) in %d of "
                    "%d steps: that replica is likely faulty (hardware, data, silent corruption); check it "
                    "(docs/faulty_replicas.md)",
                    self.mode,
                    k,
                    self.ranks[k],
                    count,
                    self.steps,
                )

    def record_trimmed(self, outside: list[int], coords: int, kept: int) -> None:
        """Coordinate-wise rules, one step: per replica the coordinates trimmed away out of `coords`,
        with `kept` of the n sorted positions averaged."""
        n = len(self.ranks)
        share = [c / max(coords, 1) for c in outside]
        self.last_trimmed = share
        threshold = (1 - kept / n + 1) / 2
        self.record([k for k, s in enumerate(share) if s > threshold])

    def as_metrics(self, prefix: str = "robust") -> dict[str, float]:
        """Counters for a logger: steps dropped per replica (by rank) and how many were dropped last step."""
        out = {f"{prefix}/dropped_rank{r}": float(c) for r, c in zip(self.ranks, self.dropped)}
        out[f"{prefix}/dropped_last_step"] = float(len(self.last_dropped))
        return out
