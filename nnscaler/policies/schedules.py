"""Pipeline schedules: the order in which each device group runs forward and backward passes of
(stage, micro-batch), and a simulator that checks the orders cannot deadlock and measures their bubble.

Stage s runs on device group s % pp_size (a V for zbv and dualpipev: pipeline_actions.stage_group).
Zero-bubble schedules (nnscaler/policies/zero_bubble.py) add weight-gradient passes 'W'. A forward of (s, m) needs the forward of (s - 1, m); a
backward of (s, m) needs the forward of (s, m) and the backward of (s + 1, m). Sends are
asynchronous and receives block just before their first use, so a schedule runs iff the simulator
below finishes it (with buffered sends; the P2P order the executor issues is checked under NCCL's
rules by nnscaler/policies/nccl_sim.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from nnscaler.errors import PlanError
from nnscaler.policies.pipeline_actions import ZERO_BUBBLE, Action, stage_group
from nnscaler.policies.zero_bubble import zero_bubble_actions

__all__ = [
    "Action",
    "SCHEDULER_NAMES",
    "group_actions",
    "forward_order",
    "simulate",
    "ScheduleTiming",
    "theoretical_bubble",
]

SCHEDULER_NAMES = ("gpipe", "1f1b", "1f1b_interleaved", *ZERO_BUBBLE)


def _gpipe(stage: int, nmicros: int) -> list[Action]:
    return [Action("F", stage, m) for m in range(nmicros)] + [Action("B", stage, m) for m in range(nmicros)]


def _one_f_one_b(stage: int, nstages: int, nmicros: int) -> list[Action]:
    """Warm up with (nstages - stage - 1) forwards, then alternate, then drain the backwards."""
    warmup = min(nstages - stage - 1, nmicros)
    out = [Action("F", stage, m) for m in range(warmup)]
    for i in range(nmicros - warmup):
        out += [Action("F", stage, warmup + i), Action("B", stage, i)]
    out += [Action("B", stage, m) for m in range(nmicros - warmup, nmicros)]
    return out


def _interleaved(group: int, pp_size: int, chunks: int, nmicros: int) -> list[Action]:
    """Megatron-LM's interleaved 1F1B: micro-batches go through the chunks in rounds of pp_size."""
    total = nmicros * chunks

    def fwd(k: int) -> Action:
        chunk = (k % (pp_size * chunks)) // pp_size
        micro = (k // (pp_size * chunks)) * pp_size + k % pp_size
        return Action("F", chunk * pp_size + group, micro)

    def bwd(k: int) -> Action:
        chunk = chunks - 1 - (k % (pp_size * chunks)) // pp_size
        micro = (k // (pp_size * chunks)) * pp_size + k % pp_size
        return Action("B", chunk * pp_size + group, micro)

    warmup = total if nmicros == pp_size else min((pp_size - group - 1) * 2 + (chunks - 1) * pp_size, total)
    out = [fwd(k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [fwd(warmup + k), bwd(k)]
    out += [bwd(k) for k in range(total - warmup, total)]
    return out


def group_actions(scheduler: str, nstages: int, pp_size: int, nmicros: int, group: int) -> list[Action]:
    """What device group `group` runs, in order, for one train step."""
    if scheduler in ZERO_BUBBLE:
        if nstages % pp_size:
            raise PlanError(f"{nstages} pipeline stages cannot be spread evenly over {pp_size} device groups")
        return list(_zero_bubble(scheduler, nstages, pp_size, nmicros)[group])
    if nstages % pp_size:
        raise PlanError(f"{nstages} pipeline stages cannot be spread evenly over {pp_size} device groups")
    chunks = nstages // pp_size
    if scheduler == "1f1b_interleaved":
        if nmicros % pp_size:
            raise PlanError(
                f"pipeline_scheduler '1f1b_interleaved' needs pipeline_nmicros ({nmicros}) to be a multiple of "
                f"the number of pipeline device groups ({pp_size})"
            )
        return _interleaved(group, pp_size, chunks, nmicros)
    if chunks != 1:
        raise PlanError(
            f"{nstages} stages on {pp_size} device groups (virtual stages) need pipeline_scheduler "
            f"'1f1b_interleaved' (or, for exactly two per group, the V-shaped 'zbv' / 'dualpipev'), not {scheduler!r}"
        )
    if scheduler == "gpipe":
        return _gpipe(group, nmicros)
    if scheduler == "1f1b":
        return _one_f_one_b(group, nstages, nmicros)
    raise PlanError(f"unknown pipeline_scheduler {scheduler!r}: use one of {', '.join(SCHEDULER_NAMES)}")


@lru_cache(maxsize=32)
def _zero_bubble(scheduler: str, nstages: int, pp_size: int, nmicros: int) -> tuple[tuple[Action, ...], ...]:
    """Every group's zero-bubble actions (cached: codegen asks once per rank)."""
    return tuple(tuple(o) for o in zero_bubble_actions(scheduler, nstages, pp_size, nmicros))


def forward_order(scheduler: str, nstages: int, pp_size: int, nmicros: int, group: int) -> list[Action]:
    """The forwards of `group_actions` alone (inference)."""
    return [a for a in group_actions(scheduler, nstages, pp_size, nmicros, group) if a.kind == "F"]


@dataclass(frozen=True)
class ScheduleTiming:
    """Simulated run with fixed times per forward / backward: per-group busy and idle time."""

    makespan: float
    busy: tuple[float, ...]

    @property
    def idle_fraction(self) -> tuple[float, ...]:
        return tuple(1.0 - b / self.makespan for b in self.busy)


def simulate(
    scheduler: str,
    nstages: int,
    pp_size: int,
    nmicros: int,
    forward_time: float = 1.0,
    backward_time: float = 2.0,
) -> ScheduleTiming:
    """Run every group's actions with blocking receives; raise PlanError on a deadlock.

    A backward split off its W costs backward_time / 2, its W the other half."""
    orders = [group_actions(scheduler, nstages, pp_size, nmicros, g) for g in range(pp_size)]
    check_actions(scheduler, nstages, pp_size, nmicros, orders)
    split = {(a.stage, a.micro) for order in orders for a in order if a.kind == "W"}
    done: dict[Action, float] = {}
    pos = [0] * pp_size
    clock = [0.0] * pp_size
    busy = [0.0] * pp_size
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for g in range(pp_size):
            while pos[g] < len(orders[g]):
                a = orders[g][pos[g]]
                deps = _deps(a, nstages)
                if any(d not in done for d in deps):
                    break
                start = max([clock[g]] + [done[d] for d in deps])
                cost = forward_time if a.kind == "F" else backward_time
                if a.kind == "W" or (a.kind == "B" and (a.stage, a.micro) in split):
                    cost /= 2  # a forward is whole whether or not its backward is split
                cost /= nstages // pp_size  # a virtual stage holds 1/chunks of the group's layers
                clock[g] = start + cost
                busy[g] += cost
                done[a] = clock[g]
                pos[g] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {g: orders[g][pos[g]] for g in range(pp_size) if pos[g] < len(orders[g])}
            raise PlanError(f"schedule {scheduler!r} deadlocks: device groups wait on {stuck}")
    return ScheduleTiming(max(clock), tuple(busy))


def check_actions(
    scheduler: str, nstages: int, pp_size: int, nmicros: int, orders: list[list[Action]]
) -> None:
    """Every stage's forward and backward run once on the stage's group; a W at most once, after its B."""
    expected = {Action(k, s, m) for k in "FB" for s in range(nstages) for m in range(nmicros)}
    given = [a for order in orders for a in order]
    fb = [a for a in given if a.kind != "W"]
    if len(fb) != len(expected) or set(fb) != expected:
        raise PlanError(
            f"schedule {scheduler!r} does not run every stage's forward and backward exactly once"
        )
    for g, order in enumerate(orders):
        seen: set[Action] = set()
        for a in order:
            if stage_group(scheduler, a.stage, pp_size) != g:
                raise PlanError(f"schedule {scheduler!r} runs {a} on device group {g}, not the stage's group")
            if a.kind == "W" and (Action("B", a.stage, a.micro) not in seen or a in seen):
                raise PlanError(f"schedule {scheduler!r} runs {a} before its backward 'B' or twice")
            seen.add(a)


def _deps(a: Action, nstages: int) -> list[Action]:
    if a.kind == "F":
        return [Action("F", a.stage - 1, a.micro)] if a.stage > 0 else []
    if a.kind == "W":
        return [Action("B", a.stage, a.micro)]
    deps = [Action("F", a.stage, a.micro)]
    if a.stage + 1 < nstages:
        deps.append(Action("B", a.stage + 1, a.micro))
    return deps


def theoretical_bubble(scheduler: str, nstages: int, pp_size: int, nmicros: int) -> float:
    """The textbook idle fraction: (p - 1) / (v * m + p - 1) for p groups, v chunks, m micro-batches;
    for zero-bubble schedules the idle fraction of `simulate` (F = B = W, their papers' assumption)."""
    if scheduler in ZERO_BUBBLE:
        return max(simulate(scheduler, nstages, pp_size, nmicros, 1.0, 2.0).idle_fraction)
    chunks = nstages // pp_size if scheduler == "1f1b_interleaved" else 1
    return (pp_size - 1) / (chunks * nmicros + pp_size - 1)
