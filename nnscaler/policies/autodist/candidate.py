"""One scored configuration of the plan devices: what the search, the evaluation of a given plan
and the standard recipes all return."""

from __future__ import annotations

from dataclasses import dataclass, field

from nnscaler.policies.autodist.spmd import SpmdResult

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

    @property
    def time_per_micro(self) -> float:
        return self.step_time / self.nmicros

    def label(self) -> str:
        rc = ", recompute" if self.recompute else ""
        seed = ", megatron layout" if self.origin == "megatron" else ""
        zero = f", zero{self.zero}" if self.zero else ""
        return f"pp={self.pp} tp={self.tp} nmicros={self.nmicros}{rc}{seed}{zero}"
