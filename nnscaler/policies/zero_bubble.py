"""Zero-bubble pipeline schedules: backwards split into B (input gradients) and W (weight gradients),
the W passes moved to fill the bubbles (Qi et al. 2024, "Zero Bubble Pipeline Parallelism").

- zb_h1: one stage per device group, the memory of 1F1B (stage s keeps at most p - s micro-batches
  between their forward and their W); the W passes fill the cool-down.
- zbv: two stages per group in a V (nnscaler.policies.pipeline_actions.stage_group), the phases of the
  paper's ZB-V (as torch's ScheduleZBVZeroBubble orders them): 2(p - g) - 1 forwards of the group's
  first stage, g pairs of forwards, p - g F-B-W of its second stage, the steady F-B-W of each stage,
  then the cool-down B passes with the W passes after them; a group keeps at most 2p stage
  activations (p micro-batches of its layers: 1F1B's peak).
- dualpipev: DeepSeek-V3's DualPipe cut in half (the order of DeepSeek's DualPipeV and of torch's
  ScheduleDualPipeV): after the warm-up, each group pairs the forward of one of its stages with the
  backward of its other stage on another micro-batch, so one pass's sends and receives are in
  flight while the other computes; the second half of the cool-down splits B and W.

zb_h1 comes from a list scheduler in unit time steps (F = B = W, the paper's assumption): whenever a
group is free it runs a ready B, else a ready F its memory allows, else its oldest pending W, else it
waits. Every result is a fixed order per group, run by the executor like every schedule.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from nnscaler.errors import PlanError
from nnscaler.policies.pipeline_actions import Action, stage_group

__all__ = ["zero_bubble_actions"]


def _deps(a: Action, nstages: int) -> list[Action]:
    if a.kind == "F":
        return [Action("F", a.stage - 1, a.micro)] if a.stage > 0 else []
    if a.kind == "W":
        return [Action("B", a.stage, a.micro)]
    deps = [Action("F", a.stage, a.micro)]
    return deps + ([Action("B", a.stage + 1, a.micro)] if a.stage + 1 < nstages else [])


class _ListScheduler:
    """The greedy list scheduler of zb_h1 and zbv (see the module docstring)."""

    def __init__(self, scheduler: str, nstages: int, pp: int, nmicros: int, limit: Callable[[int], int]):
        self.nstages, self.pp, self.nmicros, self.limit = nstages, pp, nmicros, limit
        # later stages first: a micro-batch already inside the group goes on before a new one enters
        self.stages = [
            sorted((s for s in range(nstages) if stage_group(scheduler, s, pp) == g), reverse=True)
            for g in range(pp)
        ]
        self.finish: dict[Action, int] = {}
        self.next = {(k, s): 0 for k in "FB" for s in range(nstages)}
        self.pending_w: list[deque[Action]] = [deque() for _ in range(pp)]
        self.inflight = [0] * pp

    def _ready(self, a: Action, t: int) -> bool:
        return all(self.finish.get(d, t + 1) <= t for d in _deps(a, self.nstages))

    def pick(self, g: int, t: int) -> Action | None:
        entry = self.stages[g][-1]
        for kind in "BF":
            for s in self.stages[g]:
                m = self.next[kind, s]
                a = Action(kind, s, m)
                if m >= self.nmicros or not self._ready(a, t):
                    continue
                if kind == "F" and s == entry and self.inflight[g] >= self.limit(g):
                    continue
                return a
        return self.pending_w[g].popleft() if self.pending_w[g] else None

    def run(self) -> list[list[Action]]:
        orders: list[list[Action]] = [[] for _ in range(self.pp)]
        total = 3 * self.nstages * self.nmicros
        t = 0
        while len(self.finish) < total:
            for g in range(self.pp):
                if orders[g] and self.finish[orders[g][-1]] > t:
                    continue
                a = self.pick(g, t)
                if a is None:
                    continue
                orders[g].append(a)
                self.finish[a] = t + 1
                self._account(g, a)
            t += 1
            if t > 4 * total:  # cannot happen: only entries wait on memory, and W always frees it
                raise PlanError(f"zero-bubble list scheduler made no progress at step {t}")
        return orders

    def _account(self, g: int, a: Action) -> None:
        entry = self.stages[g][-1]
        if a.kind in "FB":
            self.next[a.kind, a.stage] += 1
        if a.kind == "B":
            self.pending_w[g].append(Action("W", a.stage, a.micro))
        if a.stage == entry and a.kind in "FW":
            self.inflight[g] += 1 if a.kind == "F" else -1


def _zbv(group: int, pp: int, nmicros: int) -> list[Action]:
    """ZB-V's phases for one group (see the module docstring); laid out for at least 2p - 1 micro-batches,
    the passes of micro-batches past `nmicros` are left out."""
    n = max(2 * pp - 1, nmicros)
    stage = (group, 2 * pp - 1 - group)
    count = {(k, c): 0 for k in "FBW" for c in (0, 1)}
    out: list[Action] = []

    def add(kind: str, chunk: int) -> None:
        out.append(Action(kind, stage[chunk], count[kind, chunk]))
        count[kind, chunk] += 1

    for _ in range(2 * (pp - group) - 1):
        add("F", 0)
    for _ in range(group):
        add("F", 1)
        add("F", 0)
    for _ in range(pp - group):
        for kind in "FBW":
            add(kind, 1)
    while count["F", 1] < count["F", 0] or count["F", 0] < n:
        if count["F", 0] < n:
            add("F", 0)
        add("B", 0)
        add("W", 0)
        for kind in "FBW":
            add(kind, 1)
    for _ in range(group):
        add("B", 0)
        add("B", 1)
    for _ in range(pp - group):
        add("B", 0)
        add("W", 0)
    for chunk in (1, 0):
        while count["W", chunk] < count["B", chunk]:
            add("W", chunk)
    return [a for a in out if a.micro < nmicros]


def _dualpipev(group: int, pp: int, nmicros: int) -> list[Action]:
    """DualPipeV's eight steps for one group: F0 warm-up, F0 F1, B1 W F1, the overlapped F0+B1 / F1+B0
    pairs, B1 with F1+B0, B1 B0 (the later half split), W with B0, the remaining W."""
    s0, s1 = group, 2 * pp - 1 - group
    count = {(k, s): 0 for k in "FB" for s in (s0, s1)}
    pending: deque[Action] = deque()
    out: list[Action] = []

    def add(kind: str, s: int, split: bool = False) -> None:
        m = count[kind, s]
        count[kind, s] += 1
        out.append(Action(kind, s, m))
        if kind == "B" and split:  # else a full backward: weight gradients too, no W of its own
            pending.append(Action("W", s, m))

    def weight() -> None:
        if pending:
            out.append(pending.popleft())

    for _ in range(2 * (pp - group - 1)):
        add("F", s0)
    for _ in range(group + 1):
        add("F", s0)
        add("F", s1)
    for _ in range(pp - group - 1):
        add("B", s1, split=True)
        weight()
        add("F", s1)
    for _ in range(nmicros - 2 * pp + group + 1):
        add("F", s0)  # overlapped pair: forward of one stage, backward of the other
        add("B", s1)
        add("F", s1)
        add("B", s0)
    for _ in range(pp - group - 1):
        add("B", s1)
        add("F", s1)
        add("B", s0)
    split = False
    for i in range(group + 1):
        split = split or (i == (group + 1) // 2 and group % 2 == 1)
        add("B", s1, split)
        split = split or (i == (group + 1) // 2 and group % 2 == 0)
        add("B", s0, split)
    for _ in range(pp - group - 1):
        weight()
        add("B", s0, split)
    while pending:
        weight()
    return out


def zero_bubble_actions(scheduler: str, nstages: int, pp: int, nmicros: int) -> list[list[Action]]:
    """Every group's actions (F, B and W) under a zero-bubble schedule, by group."""
    v = nstages // pp
    if scheduler == "zb_h1":
        if v != 1:
            raise PlanError(
                f"pipeline_scheduler 'zb_h1' runs one stage per device group, got {nstages} over {pp}"
            )
        return _ListScheduler(scheduler, nstages, pp, nmicros, lambda g: pp - g).run()
    if v != 2:
        raise PlanError(
            f"pipeline_scheduler {scheduler!r} runs exactly two stages per device group (a V): "
            f"set pipeline_nstages to 2 x {pp} = {2 * pp}, got {nstages}"
        )
    if scheduler == "zbv":
        return [_zbv(g, pp, nmicros) for g in range(pp)]
    if nmicros < nstages:
        raise PlanError(
            f"pipeline_scheduler 'dualpipev' needs at least as many micro-batches as stages: "
            f"pipeline_nmicros is {nmicros}, the V has {nstages} stages"
        )
    return [_dualpipev(g, pp, nmicros) for g in range(pp)]
