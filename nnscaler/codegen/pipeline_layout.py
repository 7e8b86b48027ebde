"""Which global rank runs which pipeline stage, and the process groups that follow from it."""

from __future__ import annotations

from nnscaler.config import ComputeConfig
from nnscaler.policies.pipeline_actions import stage_group

__all__ = ["PipelineLayout"]


class PipelineLayout:
    """Which global rank runs which stage: stage s on device group s % pp_size of each replica (a V for
    the V-shaped schedules: nnscaler.policies.pipeline_actions.stage_group)."""

    def __init__(self, cfg: ComputeConfig, pp_size: int, scheduler: str = "1f1b"):
        self.cfg, self.pp_size, self.tp = cfg, pp_size, cfg.plan_ngpus // pp_size
        self.scheduler = scheduler

    def group_of(self, stage: int) -> int:
        """The device group running `stage`."""
        return stage_group(self.scheduler, stage, self.pp_size)

    def position(self, rank: int) -> tuple[int, int, int]:
        """(replica base rank, device group, index inside the group's tensor parallelism)."""
        device = rank % self.cfg.plan_ngpus
        return rank - device, device // self.tp, device % self.tp

    def rank(self, base: int, group: int, tp_index: int) -> int:
        return base + group * self.tp + tp_index

    def stage_rank(self, rank: int, stage: int) -> int:
        """The rank running `stage` that exchanges activations with `rank` (same replica and tp index)."""
        base, _, i = self.position(rank)
        return self.rank(base, self.group_of(stage), i)

    def tp_group(self, rank: int) -> list[int]:
        base, g, _ = self.position(rank)
        return [self.rank(base, g, i) for i in range(self.tp)]

    def pp_group(self, rank: int) -> list[int]:
        base, _, i = self.position(rank)
        return [self.rank(base, g, i) for g in range(self.pp_size)]

    def all_groups(self, tied_devices: list[list[int]]) -> list[list[int]]:
        """Every tp, pp and tied-weight group of every replica (each rank creates all, in this order)."""
        out: list[list[int]] = []
        for rank in range(self.cfg.runtime_ngpus):
            for grp in (self.tp_group(rank), self.pp_group(rank)):
                if grp not in out:
                    out.append(grp)
        for groups in tied_devices:
            for base in range(0, self.cfg.runtime_ngpus, self.cfg.plan_ngpus):
                for i in range(self.tp):
                    grp = [self.rank(base, g, i) for g in groups]
                    if grp not in out:
                        out.append(grp)
        return out
