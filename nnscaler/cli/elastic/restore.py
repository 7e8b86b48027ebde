"""After a restart: find the newest step a complete set of surviving snapshots holds, and stage it.

Every rank reports its node's snapshot inventory (own and peer copies); a step is complete when the
surviving nodes together hold a file for every rank of the world that wrote it. Files a node lacks are
sent to it from a node that has them, so each node's step directory becomes a whole per-rank checkpoint
(`complete.json` included) that the Trainer's resume path loads under the new plan and world size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from nnscaler.cli.elastic import store
from nnscaler.cli.elastic.membership import Membership, node_key
from nnscaler.runtime.checkpoint.save_types import SHARDED

__all__ = ["Survey", "survey", "stage"]


@dataclass
class Survey:
    """What the surviving nodes hold."""

    nodes: dict[str, dict[int, dict[int, dict[str, Any]]]]
    """node key -> {step: {rank: description}}."""
    reached: int
    """The newest step any node had started a snapshot for (the progress made before the failure)."""
    node_of_rank: dict[int, str] = field(default_factory=dict)
    """Each new rank's node key."""

    def complete_step(self) -> int | None:
        """The newest step whose rank files, over all nodes, cover the world that wrote it."""
        steps = sorted({s for inv in self.nodes.values() for s in inv}, reverse=True)
        for s in steps:
            files = self.files(s)
            worlds = {meta["world_size"] for meta in files.values()}
            if len(worlds) == 1 and set(files) >= set(range(worlds.pop())):
                return s
        return None

    def files(self, step: int) -> dict[int, dict[str, Any]]:
        """rank -> description of the rank files of `step` any node holds."""
        out: dict[int, dict[str, Any]] = {}
        for inv in self.nodes.values():
            for r, meta in inv.get(step, {}).items():
                out.setdefault(r, meta)
        return out

    def lost_ranks(self, step: int) -> list[int]:
        """Ranks of the old world whose own copy is gone (only a peer's copy survives)."""
        own = {r for inv in self.nodes.values() for r, m in inv.get(step, {}).items() if m["holder"] == "own"}
        return sorted(set(self.files(step)) - own)

    def lost_nodes(self, step: int) -> list[int]:
        """The old world's node indices of the lost ranks."""
        files = self.files(step)
        return sorted({files[r].get("node", -1) for r in self.lost_ranks(step)})


def survey(root: Path, member: Membership, group: Any) -> Survey:
    """Every node's inventory (one all-gather over the side group)."""
    mine = (node_key(root), store.inventory(root), store.reached_step(root))
    everyone = [mine]
    if group is not None:
        everyone = [None] * member.world_size
        dist.all_gather_object(everyone, mine, group=group)
    nodes = {key: inv for key, inv, _ in everyone}
    return Survey(
        nodes=nodes,
        reached=max(r for *_, r in everyone),
        node_of_rank={rank: key for rank, (key, *_) in enumerate(everyone)},
    )


def stage(root: Path, step: int, found: Survey, member: Membership, group: Any) -> Path:
    """Make `root`'s directory of `step` a whole checkpoint on every node: missing rank files are
    broadcast from the lowest rank whose node holds them; node leaders write them and `complete.json`,
    and drop the snapshots of other steps (they belong to the world that failed)."""
    here = node_key(root)
    d = store.step_dir(root, step)
    files = found.files(step)
    for r in sorted(files):
        needy = [key for key, inv in found.nodes.items() if r not in inv.get(step, {})]
        if not needy:
            continue
        src = min(rank for rank, key in found.node_of_rank.items() if r in found.nodes[key].get(step, {}))
        box: list[Any] = [None]
        if member.rank == src:
            box = [((d / f"{r}.ckpt").read_bytes(), files[r])]
        dist.broadcast_object_list(box, src=src, group=group)
        if here in needy and member.is_node_leader:
            data, meta = box[0]
            store.write_rank(root, step, r, data, {**meta, "holder": "fetched"})
    if member.is_node_leader:
        world = next(iter(files.values()))["world_size"]
        first = files[0]
        info = {
            "save_type": SHARDED,
            "world_size": world,
            "plans": [files[r]["plan"] for r in range(world)],
            "plan_ngpus": first["plan_ngpus"],
            "step": step,
            "epoch": first["epoch"],
            "loss": None,
            "source": "in-memory snapshot",
        }
        store.write_atomic(d / "complete.json", json.dumps(info, indent=1).encode())
        store.prune_before(root, 1 << 62, keep=step)
    if group is not None:
        dist.barrier(group=group)
    return d
