"""One scored configuration of the plan devices: what the search, the evaluation of a given plan
and the standard recipes all return."""

from __future__ import annotations

from dataclasses import dataclass, field

from nnscaler.policies.autodist.spmd import SpmdResult
from nnscaler.policies.plan import ContextParallel

__all__ = ["Candidate"]


@dataclass
class Candidate:
    """One scored configuration of the plan devices."""

    pp: int
    tp: int
    nmicros: int
    recompute: bool
    step_time: float
    """Seconds per step of `nmicros` micro-batches."""
    memory: float
    """Bytes on the fullest device."""
    spmd: SpmdResult
    starts: list[int] = field(default_factory=list)
    """Node index where each pipeline stage starts (pp > 1)."""
    stage_times: list[float] = field(default_factory=list)
    recompute_paths: tuple[str, ...] = ()
    zero: int = 0
    """ZeRO stage the candidate was costed with (shown in its label when not 0)."""
    origin: str = "ilp"
    """'ilp': the searched partition; 'megatron': the tp policy's layout, kept where the model scores it
    better (the ILP works on folded layers and per-edge costs, so a hand-made layout can edge it out)."""
    cp: ContextParallel | None = None
    """The sequence split over `cp.size` more devices per stage (pp and tp count the rest); None: off."""
    cp_comm: float = 0.0
    """Seconds per step of context-parallel communication (all of it, overlapped with compute or not)."""
    cp_exposed: float = 0.0
    """Seconds per step context parallelism adds to the step: communication not hidden behind attention,
    the reorder and Ulysses all-to-alls, a plain ring's causal imbalance (included in step_time)."""
    cp_rejected: tuple[tuple[str, str], ...] = ()
    """(configuration, why not taken) for the other context-parallel degrees and kinds (on the winner)."""
    ep: int = 1
    """Expert-parallel degree: the batch and the experts split over `ep` more devices per stage (pp and
    tp count the rest); 1: off (autodist/expert_parallel.py)."""
    ep_bytes: float = 0.0
    """Bytes per step one device sends and receives in the experts' all-to-alls (every layer, every
    micro-batch, forward and backward)."""
    ep_comm: float = 0.0
    """Seconds per step of those all-to-alls (not overlapped: included in step_time)."""
    ep_rejected: tuple[tuple[str, str], ...] = ()
    """(configuration, why not taken) for the other expert-parallel degrees (on the winner)."""
    scheduler: str = "1f1b"
    """The pipeline schedule (pp > 1): the searched one under pipeline_scheduler 'auto' (schedule_choice.py)."""
    bubble_share: float = 0.0
    """Idle share of the step on the slowest device under that schedule (pp > 1)."""
    schedule_options: tuple = ()
    """Every schedule costed on this configuration (schedule_choice.ScheduleOption), with why not taken."""

    @property
    def time_per_micro(self) -> float:
        return self.step_time / self.nmicros

    def label(self) -> str:
        rc = ", recompute" if self.recompute else ""
        seed = ", megatron layout" if self.origin == "megatron" else ""
        zero = f", zero{self.zero}" if self.zero else ""
        cp = f" cp={self.cp.size} ({self.cp_label()})" if self.cp else ""
        ep = f" ep={self.ep}" if self.ep > 1 else ""
        sched = (
            f" {self.scheduler} x{len(self.starts)} stages"
            if self.pp > 1 and self.scheduler != "1f1b"
            else ""
        )
        return f"pp={self.pp}{cp}{ep} tp={self.tp} nmicros={self.nmicros}{sched}{rc}{seed}{zero}"

    @property
    def cp_size(self) -> int:
        return self.cp.size if self.cp else 1

    def cp_label(self) -> str:
        """'zigzag', or 'hybrid u2' (Ulysses groups of 2, ring across them)."""
        if self.cp is None:
            return "off"
        return f"hybrid u{self.cp.ulysses_size}" if self.cp.kind == "hybrid" else self.cp.kind
