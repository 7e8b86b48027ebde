"""What an nnScaler 0.8-style policy did, as plain data: the IRGraph front records it, and
nnscaler.policies.policy_api08 turns it into a Plan (the single source of truth)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["NodeFate", "ScheduleRecord", "PolicyRecord"]


@dataclass
class NodeFate:
    """What happened to one traced node.

    kind: 'whole' (assigned without a transform), 'replicate' or 'partition'.
    ident / idx / dim: the annotation identifier split and the (input, dim) the policy named.
    devices: the device of each piece (None: never assigned), in piece order.
    call: the transform call as the policy wrote it, for error messages.
    """

    kind: str
    devices: list[int | None]
    call: str
    ident: str | None = None
    idx: int | None = None
    dim: int | None = None

    @property
    def num(self) -> int:
        return len(self.devices)


@dataclass(frozen=True)
class ScheduleRecord:
    """cfg.apply_pipeline_scheduler(graph, nstages, nmicros, scheduler) / PredefinedSched.sched_*."""

    nstages: int
    nmicros: int
    scheduler: str
    call: str


@dataclass
class PolicyRecord:
    """Every decision of the policy, keyed by traced node names."""

    fates: dict[str, NodeFate] = field(default_factory=dict)
    stage_starts: list[str] | None = None
    staging_call: str = ""
    schedule: ScheduleRecord | None = None
    recompute_groups: list[tuple[list[str], str]] = field(default_factory=list)
    """(traced node names, the call) per graph.recompute(...)."""
