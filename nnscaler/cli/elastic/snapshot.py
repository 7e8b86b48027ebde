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
import math
import shutil
import threading
import time
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


def cloned(obj: Any, reuse: Any = None) -> Any:
    """A copy of `obj` whose tensors are detached CPU copies (the training loop may change the originals).
    Tensors of `reuse` (an earlier copy of the same structure) of the same shape and dtype are
    overwritten instead of allocating new ones: fresh host memory costs page faults every step."""
    if isinstance(obj, torch.Tensor):  # host memory: a GPU tensor is copied to the CPU here
        src = obj.detach()
        if isinstance(reuse, torch.Tensor) and reuse.shape == src.shape and reuse.dtype == src.dtype:
            return reuse.copy_(src)
        return src.to("cpu", copy=True)
    if isinstance(obj, dict):
        old = reuse if isinstance(reuse, dict) else {}
        return {k: cloned(v, old.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        old = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) else [None] * len(obj)
        return type(obj)(cloned(v, o) for v, o in zip(obj, old))
    return obj


def capture(trainer: Any, reuse: Any = None) -> dict[str, Any]:
    """This rank's state as its `sharded` disk checkpoint file holds it, cloned at this step boundary
    (into the tensors of `reuse`, the previous capture, where they fit)."""
    model_sd, opt_sd = local_state_dicts(trainer.model, trainer.optimizer, SHARDED)
    # the same entries as a disk checkpoint's rank file, so the resume path reads a snapshot as one
    return cloned({**_resume._common(trainer), "model": model_sd, "optimizer": opt_sd}, reuse)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


AUTO_COST_SHARE = 0.05
"""`snapshot_every` None: snapshots may cost this share of the training time (the issue's 1.05x)."""


class SnapshotWriter:
    """Takes a snapshot every `every` steps (0: never), one at a time, overlapped with the next step.

    `auto`: every step when a snapshot's cost (the boundary's copy and the background write) is at most
    AUTO_COST_SHARE of a step, else the smallest interval for which it is; the ranks agree on the
    interval (the largest any rank asks for) when they commit a snapshot, so they snapshot together."""

    def __init__(self, every: int, root: Path, member: Membership, group: Any, auto: bool = False):
        self.every, self.root, self.member, self.group = every, Path(root), member, group
        self.auto = auto
        self.next_step: int | None = None
        """auto: the step of the next snapshot (None: after the first measured step / not agreed yet)."""
        self._thread: threading.Thread | None = None
        self._previous: Any = None
        self._inbox: torch.Tensor | None = None
        self._last_boundary: float | None = None
        self._capture_s = 0.0
        self._write_started = False
        self.quiet_seconds: list[float] = []
        """auto: the last few times of steps with no snapshot written during them (boundary copies left out)."""
        self.busy_seconds: list[float] = []
        """auto: the same for steps during which a snapshot was written: the difference is its cost."""
        self.error: BaseException | None = None
        self.bytes_own = 0
        """Size of this rank's newest serialized snapshot (a peer's copy of it is the same size)."""
        self.committed = -1
        """The newest step every rank's snapshot (and its peer copy) is complete for."""

    def _due(self, step: int) -> bool:
        now = time.perf_counter()
        if self._last_boundary is not None:
            seconds = now - self._last_boundary - self._capture_s
            if self._write_started:
                self.busy_seconds = [*self.busy_seconds[-7:], seconds]
            else:
                self.quiet_seconds = [*self.quiet_seconds[-7:], seconds]
        self._last_boundary, self._capture_s, self._write_started = now, 0.0, False
        if not self.every:
            return False
        if not self.auto:
            return step % self.every == 0
        if self._thread is not None:
            self.wait()  # the commit agrees on the next snapshot's step
        if self.next_step is None and self.quiet_seconds and self.committed < 0:
            self.next_step = step  # the first snapshot: once one step has been timed
        return self.next_step is not None and step >= self.next_step

    def maybe_take(self, trainer: Any) -> None:
        """At a step boundary: snapshot when one is due."""
        step = trainer.train_status["step"]
        if not self._due(step):
            return
        t0 = time.perf_counter()
        self.wait()  # one snapshot in flight at a time: the previous capture's buffers are free again
        payload = capture(trainer, self._previous)
        self._previous = payload
        if self.committed < 0 and not self._fits(payload):
            return
        store.step_dir(self.root, step).mkdir(parents=True, exist_ok=True)  # marks the step reached
        meta = {
            "step": step,
            "epoch": trainer.train_status["next_epoch"],
            "world_size": self.member.world_size,
            "rank": self.member.rank,
            "node": self.member.node,
            "plan": plan_of(trainer.model),
            "plan_ngpus": trainer.train_args.compute_config.plan_ngpus,
        }
        self.next_step = None
        self._capture_s, self._write_started = time.perf_counter() - t0, True
        self._thread = threading.Thread(
            target=self._write,
            args=(step, payload, meta, self._capture_s),
            name=f"nnscaler-snapshot-{step}",
            daemon=True,
        )
        self._thread.start()

    def _proposed_every(self, capture_s: float, write_s: float) -> int:
        """auto: the smallest interval at which snapshots fit AUTO_COST_SHARE of the training time. A
        snapshot costs its boundary copy plus what it slows the step it is written in by (measured:
        busy against quiet steps; before any busy step is timed, the write's own time)."""
        if not self.quiet_seconds:
            return 1
        quiet = _median(self.quiet_seconds)
        slowed = _median(self.busy_seconds) - quiet if self.busy_seconds else write_s
        cost = capture_s + max(slowed, 0.0)
        return max(1, min(10_000, math.ceil(cost / (AUTO_COST_SHARE * max(quiet, 1e-6)))))

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

    def _write(self, step: int, payload: dict[str, Any], meta: dict[str, Any], capture_s: float) -> None:
        t0 = time.perf_counter()
        try:
            buf = io.BytesIO()
            # the pickle format (not the zip one): a third of the CPU time here, and torch.load reads both
            torch.save(payload, buf, _use_new_zipfile_serialization=False)
            n = buf.tell()
            self.bytes_own = n
            store.write_rank(
                self.root, step, self.member.rank, buf.getbuffer()[:n], {**meta, "holder": "own"}
            )
            received = self._exchange(buf, n, meta)
            if received is not None:
                data, peer_meta = received
                store.write_rank(self.root, step, peer_meta["rank"], data, {**peer_meta, "holder": "peer"})
            self._commit(step, capture_s, time.perf_counter() - t0)
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
        size = int(theirs.sum())
        if self._inbox is None or self._inbox.numel() < size:  # kept: fresh memory costs page faults
            self._inbox = torch.empty(size, dtype=torch.uint8)
        inbox = self._inbox[:size]
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

    def _commit(self, step: int, capture_s: float, write_s: float) -> None:
        """Agree that every rank stored `step` (and, auto, on the next snapshot's step); then the node
        drops older snapshots."""
        every = self._proposed_every(capture_s, write_s) if self.auto else self.every
        if self.group is not None:
            agreed = torch.tensor([-step, every], dtype=torch.int64)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
            step, every = -int(agreed[0]), int(agreed[1])
        self.committed = step
        if self.auto:
            self.every, self.next_step = every, step + every
        if self.member.is_node_leader:
            store.prune_before(self.root, step)
