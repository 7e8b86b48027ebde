"""How long a pipelined step takes under each schedule, and how many micro-batches of activations each
device keeps: the step formula the search, the evaluation of a given plan and the recipes share.

Every schedule is priced from the same inputs: the forward + backward seconds of one micro-batch on
each stage, the stage-to-device mapping, the micro-batch count and the time of one hop between
stages. A stage's time splits into forward (F), input-gradient backward (B) and weight-gradient
backward (W); with the analytic cost model's 1:2 forward:backward ratio, F = B = W = 1/3 (recomputed
layers run their forward twice: B carries it).

The bubble (idle time of the slowest device) of each schedule, for p devices, m micro-batches and a
device time T = F + B + W per micro-batch:

- gpipe, 1f1b: (p - 1) T (Narayanan et al. 2019/2021); step = (m + p - 1) T.
- 1f1b_interleaved, v stages per device: (p - 1) T / v (Narayanan et al. 2021, Megatron-LM).
- zb_h1, zbv, dualpipev: priced as the runtime runs them (`as_run`, the default): the bubble of the
  runtime's own order of F, B and W actions (nnscaler.policies.schedules.simulate, equal stages, the
  cycle repeated from 2 x stages micro-batches on, where the fill and drain no longer change), which
  keeps 1F1B's memory strictly in ZB-H1: (p - 1)(F + B) there, and fill and drain the papers'
  steady-state formulas leave out in the V schedules (0.5 T at p = 4). The papers' formulas
  (`as_run=False`):
- zb_h1: (p - 1)(F + B - W) (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", ZB-H1): W fills the
  cool-down; memory as 1F1B.
- zbv, two stages per device in a V: (p - 1)(F + B - 2W) / 2, never below 0 (the ZB-V schedule: each
  chunk's F, B and W are half the device's).
- dualpipev: (p / 2 - 1)(F&B + B - 3W) with chunk times (DeepSeek-V3's DualPipe, cut in half: the
  forward and backward chunks of two micro-batches overlapped, F&B their paired time), never below 0.

The fill and drain also pay the hops between consecutive stages: 2 (stages - 1) sends on the
critical path (forward activations in, gradients back), whatever the schedule.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from nnscaler.errors import PlanError
from nnscaler.policies.schedules import simulate

__all__ = [
    "PIPELINE_SCHEDULES",
    "StageSplit",
    "PipelineTiming",
    "device_of_stage",
    "stages_per_device",
    "pipeline_timing",
]

PIPELINE_SCHEDULES = ("gpipe", "1f1b", "1f1b_interleaved", "zb_h1", "zbv", "dualpipev")
"""Schedules this module prices (the runtime runs those in nnscaler.policies.plan.SCHEDULERS)."""

_V_SHAPED = ("zbv", "dualpipev")


@dataclass(frozen=True)
class StageSplit:
    """Shares of a stage's forward + backward time: forward (F), input gradient (B), weight gradient (W)."""

    forward: float = 1.0 / 3.0
    input_grad: float = 1.0 / 3.0
    weight_grad: float = 1.0 / 3.0

    @classmethod
    def for_recompute(cls, recompute: bool) -> StageSplit:
        """F:B:W = 1:1:1 (a matmul's backward is two matmuls), 1:2:1 when the forward runs again in B."""
        return cls(0.25, 0.5, 0.25) if recompute else cls()


@dataclass(frozen=True)
class PipelineTiming:
    """The step of one pipeline schedule."""

    step: float
    """Seconds from the first forward to the last backward (without the data-parallel sync)."""
    busy: float
    """Seconds the slowest device computes: m micro-batches of its stages."""
    bubble: float
    """Seconds the slowest device idles in fill and drain (step - busy - hops)."""
    hops: float
    """Seconds of stage-to-stage sends on the critical path."""
    inflight: tuple[float, ...]
    """Micro-batches of its stages' activations each device keeps at its peak (by device)."""

    @property
    def bubble_share(self) -> float:
        return self.bubble / self.step if self.step > 0 else 0.0


def device_of_stage(schedule: str, stage: int, pp: int) -> int:
    """The device group running `stage`: round robin (interleaved), or a V (zbv, dualpipev: stage s and
    stage 2p - 1 - s share a device)."""
    if schedule in _V_SHAPED:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def stages_per_device(schedule: str, nstages: int, pp: int) -> int:
    """v: stages each device runs (1 for plain schedules, 2 for the V-shaped ones); ValueError when the
    stage count does not fit the schedule."""
    if nstages % pp:
        raise ValueError(f"{nstages} stages do not divide over {pp} devices")
    v = nstages // pp
    if schedule in _V_SHAPED and v != 2:
        raise ValueError(f"schedule {schedule!r} runs exactly 2 stages per device, got {nstages} over {pp}")
    if schedule in ("gpipe", "1f1b", "zb_h1") and v != 1:
        raise ValueError(f"schedule {schedule!r} runs one stage per device, got {nstages} over {pp}")
    return v


def pipeline_timing(
    schedule: str,
    stage_times: list[float],
    pp: int,
    nmicros: int,
    hop: float = 0.0,
    split: StageSplit = StageSplit(),
    as_run: bool = True,
) -> PipelineTiming:
    """The step of `schedule` over `pp` devices for stages taking `stage_times` seconds (forward +
    backward of one micro-batch each), `nmicros` micro-batches, `hop` seconds per stage-to-stage send;
    zero-bubble schedules by the runtime's order (`as_run`) or the papers' formulas."""
    if schedule not in PIPELINE_SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {schedule!r}: use one of {PIPELINE_SCHEDULES}")
    nstages = len(stage_times)
    v = stages_per_device(schedule, nstages, pp)
    per_device = [0.0] * pp
    for s, t in enumerate(stage_times):
        per_device[device_of_stage(schedule, s, pp)] += t
    t_dev = max(per_device)
    busy = nmicros * t_dev
    f, b, w = (t_dev * x for x in (split.forward, split.input_grad, split.weight_grad))
    if schedule in ("gpipe", "1f1b"):
        bubble = (pp - 1) * t_dev
    elif schedule == "1f1b_interleaved":
        bubble = (pp - 1) * t_dev / v
    elif (
        as_run
        and schedule in _SPLIT_BACKWARD
        and _run_bubble(schedule, nstages, pp, nmicros, split) is not None
    ):
        bubble = _run_bubble(schedule, nstages, pp, nmicros, split) * t_dev
    elif schedule == "zb_h1":
        bubble = (pp - 1) * max(f + b - w, 0.0)
    elif schedule == "zbv":
        bubble = (pp - 1) * max(f + b - 2 * w, 0.0) / 2
    else:  # dualpipev: chunk times are half the device's
        fc, bc, wc = f / 2, b / 2, w / 2
        bubble = max(pp / 2 - 1, 0.0) * max((fc + bc) + bc - 3 * wc, 0.0)
    hops = 2 * (nstages - 1) * hop
    return PipelineTiming(busy + bubble + hops, busy, bubble, hops, _inflight(schedule, pp, v, nmicros))


_SPLIT_BACKWARD = ("zb_h1", "zbv", "dualpipev")


def _run_bubble(schedule: str, nstages: int, pp: int, nmicros: int, split: StageSplit) -> float | None:
    """Idle time of the slowest device in units of its time per micro-batch, running the runtime's own
    order (None where the runtime refuses the shape)."""
    return _simulated_bubble(
        schedule, nstages, pp, min(nmicros, 2 * nstages), split.forward, split.input_grad + split.weight_grad
    )


@functools.lru_cache(maxsize=512)
def _simulated_bubble(
    schedule: str, nstages: int, pp: int, nmicros: int, forward: float, backward: float
) -> float | None:
    try:
        t = simulate(schedule, nstages, pp, nmicros, forward, backward)
    except PlanError:
        return None
    return (t.makespan - max(t.busy)) / (forward + backward)


def _inflight(schedule: str, pp: int, v: int, nmicros: int) -> tuple[float, ...]:
    """Micro-batches of a device's activations kept at its peak, by device.

    gpipe keeps all m; 1F1B and ZB-H1 keep p - d on device d (Narayanan et al. 2021); interleaved
    keeps the warm-up chunks Megatron-LM's schedule runs, 2 (p - d - 1) + (v - 1) p + 1 chunks of
    1/v each; ZB-V keeps p on every device (its V balances memory); DualPipeV p + 1.
    """
    out = []
    for d in range(pp):
        if schedule == "gpipe":
            keep = float(nmicros)
        elif schedule in ("1f1b", "zb_h1"):
            keep = float(pp - d)
        elif schedule == "1f1b_interleaved":
            keep = (2 * (pp - d - 1) + (v - 1) * pp + 1) / v
        elif schedule == "zbv":
            keep = float(pp)
        else:
            keep = float(pp + 1)
        out.append(min(keep, float(nmicros)))
    return tuple(out)
