"""Which pipeline schedule a pipelined configuration runs: every schedule the runtime can run is costed
on the same stage cut (one stage per device, or two for the interleaved and V-shaped schedules) and the
fastest that fits the memory limit is taken; the others stay on the candidate with why not, for the
report.

The bubble and the activations each schedule keeps come from pipeline_time.py; whether a schedule can
run a given stage count and micro-batch count is asked of nnscaler.policies.schedules (the runtime's
own orders), so the planner never picks what the executor would refuse.
"""

from __future__ import annotations

from dataclasses import dataclass

from nnscaler.errors import PlanError
from nnscaler.policies.autodist.pipeline_time import PIPELINE_SCHEDULES, stages_per_device
from nnscaler.policies.plan import SCHEDULERS
from nnscaler.policies.schedules import group_actions

__all__ = ["ScheduleOption", "AUTO", "searched_schedules", "schedule_runs", "pick_schedule", "stage_counts"]

AUTO = "auto"
"""pas_config['pipeline_scheduler'] 'auto': the search picks the schedule."""

_AUTO_ORDER = ("1f1b", "zb_h1", "1f1b_interleaved", "zbv", "dualpipev")
"""What 'auto' tries (gpipe never: it keeps every micro-batch for the same bubble as 1F1B), and the
order that breaks ties (the simpler schedule first)."""


@dataclass(frozen=True)
class ScheduleOption:
    """One schedule costed on a configuration's stage cut."""

    scheduler: str
    step: float
    """Predicted seconds per step."""
    memory: float
    """Bytes on the fullest device."""
    bubble_share: float
    """Idle share of the step on the slowest device (fill and drain)."""
    nstages: int
    fits: bool
    why_not: str = ""
    """Empty for the schedule taken; otherwise why it was not (slower, over memory, cannot run)."""

    def label(self) -> str:
        return f"{self.scheduler} ({self.nstages} stages)"


def searched_schedules(pinned: str | None) -> tuple[str, ...]:
    """The schedules the search costs: the pinned one, or under 'auto' those both priced here and run
    by the runtime (nnscaler.policies.plan.SCHEDULERS)."""
    if pinned and pinned != AUTO:
        return (pinned,)
    return tuple(s for s in _AUTO_ORDER if s in SCHEDULERS and s in PIPELINE_SCHEDULES)


def stage_counts(schedules: tuple[str, ...], pp: int) -> dict[int, tuple[str, ...]]:
    """Stage count -> the schedules that run that many stages over `pp` device groups."""
    out: dict[int, list[str]] = {}
    for s in schedules:
        v = 2 if s in ("1f1b_interleaved", "zbv", "dualpipev") else 1
        out.setdefault(v * pp, []).append(s)
    return {n: tuple(v) for n, v in out.items()}


def schedule_runs(scheduler: str, nstages: int, pp: int, nmicros: int) -> str | None:
    """Why the runtime cannot run `scheduler` for this shape (None: it can)."""
    try:
        stages_per_device(scheduler, nstages, pp)
        group_actions(scheduler, nstages, pp, nmicros, 0)
    except (PlanError, ValueError) as exc:
        return str(exc)
    return None


def pick_schedule(options: list[ScheduleOption]) -> tuple[ScheduleOption | None, tuple[ScheduleOption, ...]]:
    """The fastest option that fits (ties: the earlier, simpler schedule) and every option with its
    reason filled in; None when none fits."""
    fitting = [o for o in options if o.fits]
    best = min(fitting, key=lambda o: o.step) if fitting else None
    out = []
    for o in options:
        if o is best:
            out.append(o)
        elif o.why_not:
            out.append(o)
        else:
            gap = o.step - best.step if best else 0.0
            out.append(
                ScheduleOption(
                    o.scheduler,
                    o.step,
                    o.memory,
                    o.bubble_share,
                    o.nstages,
                    o.fits,
                    f"{gap * 1e3:.3f} ms slower (bubble {o.bubble_share:.1%} of its step)",
                )
            )
    return best, tuple(out)
