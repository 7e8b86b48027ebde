"""The units of a pipeline schedule and where each stage runs.

An `Action` is one piece of work of one stage on one micro-batch: its forward ('F'), its backward
('B': the gradients of the stage's inputs, and of its weights too unless the schedule also has a 'W'
for that stage and micro-batch) or its weight-gradient backward ('W', zero-bubble schedules: the
gradients of the weights, later, from the graph 'B' kept).

Stage s runs on device group s % pp_size (round robin), except in the V-shaped schedules, where
stage s and stage 2 pp_size - 1 - s share a group: the first half of the stages goes down the groups
and the second half comes back up, so group 0 holds the first and the last stage.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Action", "V_SHAPED", "ZERO_BUBBLE", "stage_group", "weight_passes"]

V_SHAPED = ("zbv", "dualpipev")
"""Schedules with exactly two stages per device group, placed in a V."""

ZERO_BUBBLE = ("zb_h1", "zbv", "dualpipev")
"""Schedules that split backwards into B (input gradients) and W (weight gradients)."""


@dataclass(frozen=True)
class Action:
    """Forward ('F'), backward ('B') or weight-gradient backward ('W') of one stage on one micro-batch."""

    kind: str
    stage: int
    micro: int


def stage_group(scheduler: str, stage: int, pp_size: int) -> int:
    """The device group running `stage` under `scheduler` (a V for zbv / dualpipev, else round robin)."""
    if scheduler in V_SHAPED:
        return stage if stage < pp_size else 2 * pp_size - 1 - stage
    return stage % pp_size


def weight_passes(actions: list[Action]) -> set[tuple[int, int]]:
    """(stage, micro-batch) of every 'W' in `actions`: their 'B' computes input gradients only."""
    return {(a.stage, a.micro) for a in actions if a.kind == "W"}
