"""What the Lightning and Fabric strategies share about processes: the world matches
`runtime_ngpus`, the data-parallel replica groups, and one data shard per replica."""

from __future__ import annotations

from typing import Any

from nnscaler.errors import ConfigError

__all__ = ["ReplicaRanks"]


class ReplicaRanks:
    """Mixin for a DDP-like strategy holding `compute_config`, `world_size` and `global_rank`."""

    compute_config: Any
    world_size: int
    global_rank: int

    def _check_world(self, who: str, runner: str) -> None:
        if self.world_size != self.compute_config.runtime_ngpus:
            raise ConfigError(
                f"{who}: {runner} runs {self.world_size} processes (devices x num_nodes) but "
                f"compute_config.runtime_ngpus is {self.compute_config.runtime_ngpus}: make them equal"
            )

    def _replica_groups(self) -> list[list[int]]:
        """The ranks holding the same piece of the plan, one per data-parallel replica."""
        plan = self.compute_config.plan_ngpus
        return [list(range(i, self.world_size, plan)) for i in range(plan)]

    def _my_replica_ranks(self) -> list[int]:
        """This rank's replica group: the ranks holding the same value as this one."""
        return self._replica_groups()[self.global_rank % self.compute_config.plan_ngpus]

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One shard of the data per data-parallel replica: the ranks of a plan read the same batch."""
        plan = self.compute_config.plan_ngpus
        return {"num_replicas": self.world_size // plan, "rank": self.global_rank // plan}
