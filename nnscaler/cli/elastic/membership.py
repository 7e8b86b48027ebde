"""Where this process stands in an elastic run: its node, the run's snapshot directory, restarts.

torchrun's elastic agent (`--nnodes MIN:MAX --max-restarts N`) restarts every worker with a new
`WORLD_SIZE` when a node leaves or joins and sets `TORCHELASTIC_RESTART_COUNT` (0 on a first start,
and on a node that has just joined). Nodes are `LOCAL_WORLD_SIZE` consecutive global ranks, as torchrun
numbers them; without torchrun the whole world is one node.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from nnscaler import env_vars

__all__ = ["Membership", "membership", "snapshot_root", "agent_id", "SNAPSHOT_DIR_ENV"]

SNAPSHOT_DIR_ENV = "NNSCALER_SNAPSHOT_DIR"
"""Overrides the node's snapshot directory (one per node; tests give each simulated node its own)."""

DEFAULT_PARENT = "/dev/shm/nnscaler-snapshots"
"""tmpfs: host memory that the node keeps after a worker process dies (until reboot or deletion)."""


@dataclass(frozen=True)
class Membership:
    """This rank's place: global rank and world, ranks per node, and the agent's restart count."""

    rank: int
    world_size: int
    local_world_size: int
    restart_count: int
    run_id: str

    @property
    def node(self) -> int:
        """This rank's node index (ranks of a node are consecutive)."""
        return self.rank // self.local_world_size

    @property
    def num_nodes(self) -> int:
        return max(1, self.world_size // self.local_world_size)

    @property
    def is_node_leader(self) -> bool:
        """The rank that writes and clears what the whole node shares (local rank 0)."""
        return self.rank % self.local_world_size == 0

    @property
    def peer(self) -> int | None:
        """The rank on the next node that keeps a copy of this rank's snapshot (None on one node)."""
        return None if self.num_nodes < 2 else (self.rank + self.local_world_size) % self.world_size

    @property
    def peer_source(self) -> int | None:
        """The rank on the previous node whose snapshot copy this rank keeps."""
        return None if self.num_nodes < 2 else (self.rank - self.local_world_size) % self.world_size


def membership(rank: int, world_size: int) -> Membership:
    """This process's membership from torchrun's environment (plain values without torchrun)."""
    lws = env_vars.read("LOCAL_WORLD_SIZE") or world_size
    if lws < 1 or world_size % lws:
        lws = world_size  # uneven nodes: treat the world as one node (no peer copies)
    return Membership(
        rank=rank,
        world_size=world_size,
        local_world_size=lws,
        restart_count=env_vars.read("TORCHELASTIC_RESTART_COUNT") or 0,
        run_id=env_vars.read("TORCHELASTIC_RUN_ID") or "run",
    )


def snapshot_root(configured: str | None, run_id: str) -> Path:
    """The node's snapshot directory: TrainerArgs.snapshot_dir, else $NNSCALER_SNAPSHOT_DIR, else
    /dev/shm/nnscaler-snapshots/uid{uid}-{run id} (a run id is torchrun's --rdzv-id)."""
    chosen = configured or env_vars.read(SNAPSHOT_DIR_ENV)
    if chosen:
        return Path(chosen)
    return Path(DEFAULT_PARENT) / f"uid{os.getuid()}-{run_id}"


def node_key(root: Path) -> str:
    """Names the memory a node's ranks share: host and snapshot directory."""
    return f"{socket.gethostname()}:{root.resolve()}"


def agent_id() -> str | None:
    """The elastic agent this worker runs under (host, the agent's pid and its start time), or None
    outside torchrun. A node joining or leaving restarts the workers without counting a restart
    (TORCHELASTIC_RESTART_COUNT stays 0): snapshots written under the same agent tell such a
    re-rendezvous from a new job."""
    if env_vars.read("TORCHELASTIC_RUN_ID") is None:
        return None
    ppid = os.getppid()
    try:
        started = Path(f"/proc/{ppid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        started = "?"
    return f"{socket.gethostname()}:{ppid}:{started}"
