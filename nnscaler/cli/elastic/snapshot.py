"""In-memory step snapshots: each rank's share of the training state, every `snapshot_every` steps.

At a step boundary the main thread clones what the rank's disk checkpoint file would hold (model and
optimizer shards, LR scheduler, train status with the data position, RNG states, plan) and hands it
to a background thread, which serializes it into the node's tmpfs directory (nnscaler.cli.elastic.store),
sends a copy to the rank at the same place on the next node (a ring over nodes, on a gloo side group of
its own, so its messages never interleave with the training loop's collectives) and stores the copy it
receives from the previous node. Then all ranks agree (a MIN all-reduce on the side group) that the
step is complete everywhere, and each node drops its older snapshots: a node keeps the newest complete
step and the one being written. Losing one node loses no rank's state: its peer copy is on another node.
"""

from __future__ import annotations

import io
import json
import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import nnscaler.cli.resume as _resume
from nnscaler.cli.elastic import store
from nnscaler.cli.elastic.membership import Membership
from nnscaler.cli.mixed import plan_of
from nnscaler.runtime.checkpoint.save_types import SHARDED, local_state_dicts

__all__ = ["SnapshotWriter", "capture", "cloned"]

logger = logging.getLogger(__name__)


def cloned(obj: Any) -> Any:
    """A copy of `obj` whose tensors are detached CPU copies (the training loop may change the originals)."""
    if isinstance(obj, torch.Tensor):  # host memory: a GPU tensor is copied to the CPU here
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: cloned(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cloned(v) for v in obj)
    return obj


def capture(trainer: Any) -> dict[str, Any]:
    """This rank's state as its `sharded` disk checkpoint file holds it, cloned at this step boundary."""
    model_sd, opt_sd = local_state_dicts(trainer.model, trainer.optimizer, SHARDED)
    # the same entries as a disk checkpoint's rank file, so the resume path reads a snapshot as one
    return cloned({**_resume._common(trainer), "model": model_sd, "optimizer": opt_sd})


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


class SnapshotWriter:
    """Takes a snapshot every `every` steps (0: never), one at a time, overlapped with the next step."""

    def __init__(self, every: int, root: Path, member: Membership, group: Any):
        self.every, self.root, self.member, self.group = every, Path(root), member, group
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.bytes_own = 0
        """Size of this rank's newest serialized snapshot (a peer's copy of it is the same size)."""
        self.committed = -1
        """The newest step every rank's snapshot (and its peer copy) is complete for."""

    def maybe_take(self, trainer: Any) -> None:
        """At a step boundary: snapshot when the step is a multiple of `every`."""
        step = trainer.train_status["step"]
        if not self.every or step % self.every:
            return
        self.wait()  # one snapshot in flight at a time
        payload = capture(trainer)
        if self.committed < 0 and not self._fits(payload):
            return
        store.step_dir(self.root, step).mkdir(parents=True, exist_ok=True)  # marks the step reached
        meta = {
            "step": step,
            "epoch": trainer.train_status["next_epoch"],
            "world_size": self.member.world_size,
            "rank": self.member.rank,
            "plan": plan_of(trainer.model),
            "plan_ngpus": trainer.train_args.compute_config.plan_ngpus,
        }
        self._thread = threading.Thread(
            target=self._write, args=(step, payload, meta), name=f"nnscaler-snapshot-{step}", daemon=True
        )
        self._thread.start()

    def kept_bytes(self, one: int) -> int:
        """The most the node keeps for snapshots of `one` bytes a rank: own and peer copies, of the
        newest complete step and the one being written, for every rank of the node."""
        copies = 2 if self.member.peer is not None else 1
        return one * copies * 2 * self.member.local_world_size

    def _fits(self, payload: dict[str, Any]) -> bool:
        """Before the first snapshot: the node's snapshots must fit in half the free space of the
        snapshot directory's file system (tmpfs: host memory); else snapshots are turned off."""
        self.root.mkdir(parents=True, exist_ok=True)
        need = self.kept_bytes(_tensor_bytes(payload))
        free = shutil.disk_usage(self.root).free
        fits = torch.tensor([int(need <= free // 2)])
        if self.group is not None:  # no snapshot thread runs now: the side group is free
            dist.all_reduce(fits, op=dist.ReduceOp.MIN, group=self.group)
        if int(fits):
            return True
        self.every = 0
        logger.warning(
            "in-memory snapshots turned off on every rank: they would keep %.1f GB on this node (or another "
            "node's) but %s has %.1f GB free (give snapshot_dir a larger file system, or snapshot_every 0)",
            need / 1e9,
            self.root,
            free / 1e9,
        )
        return False

    def wait(self) -> None:
        """Until the snapshot in flight is stored (its failure is logged once, not raised: training goes on)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self.error is not None:
            logger.warning("in-memory snapshot failed on rank %d: %s", self.member.rank, self.error)
            self.error = None

    def _write(self, step: int, payload: dict[str, Any], meta: dict[str, Any]) -> None:
        try:
            buf = io.BytesIO()
            torch.save(payload, buf)
            n = buf.tell()
            self.bytes_own = n
            store.write_rank(
                self.root, step, self.member.rank, buf.getbuffer()[:n], {**meta, "holder": "own"}
            )
            received = self._exchange(buf, n, meta)
            if received is not None:
                data, peer_meta = received
                store.write_rank(self.root, step, peer_meta["rank"], data, {**peer_meta, "holder": "peer"})
            self._commit(step)
        except BaseException as err:  # a peer that died mid-exchange: the restart sorts it out
            self.error = err

    def _exchange(self, buf: io.BytesIO, n: int, meta: dict[str, Any]) -> tuple[memoryview, dict] | None:
        """Send this rank's bytes (and description) to the next node's rank; receive the previous one's."""
        m = self.member
        if m.peer is None or self.group is None:
            return None
        buf.write(json.dumps(meta).encode())
        out = torch.frombuffer(buf.getbuffer(), dtype=torch.uint8)
        header = torch.tensor([n, out.numel() - n], dtype=torch.int64)
        theirs = torch.empty(2, dtype=torch.int64)
        self._send_recv(header, theirs)
        inbox = torch.empty(int(theirs.sum()), dtype=torch.uint8)
        self._send_recv(out, inbox)
        k = int(theirs[0])
        raw = memoryview(inbox.numpy())
        return raw[:k], json.loads(bytes(raw[k:]))

    def _send_recv(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        m = self.member
        reqs = [
            dist.isend(send, m.peer, group=self.group),
            dist.irecv(recv, m.peer_source, group=self.group),
        ]
        for req in reqs:
            req.wait()

    def _commit(self, step: int) -> None:
        """Agree that every rank stored `step`; then the node drops older snapshots."""
        if self.group is not None:
            done = torch.tensor([step], dtype=torch.int64)
            dist.all_reduce(done, op=dist.ReduceOp.MIN, group=self.group)
            step = int(done)
        self.committed = step
        if self.member.is_node_leader:
            store.prune_before(self.root, step)
