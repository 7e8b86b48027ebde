"""Elastic training under torchrun's elastic agent: in-memory step snapshots, restart, re-plan.

    torchrun --nnodes 1:4 --nproc-per-node 8 --max-restarts 3 --rdzv-backend c10d \
        --rdzv-endpoint host:29400 --rdzv-id job42 -m nnscaler.cli.train -f cfg.yaml --snapshot_every 1

The Trainer calls `Elastic.prepare` once the process group exists (before compiling), `after_resume`,
`after_step` at every step boundary and `finish` when training ends; see docs/elastic.md.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
import torch.distributed as dist

from nnscaler import env_vars
from nnscaler.cli.checkpoint import checkpoint_info
from nnscaler.cli.configs import ResumeOptions
from nnscaler.cli.console import say
from nnscaler.cli.elastic import restore, store
from nnscaler.cli.elastic.membership import Membership, agent_id, membership, snapshot_root
from nnscaler.cli.elastic.replan import nearest_plan_size, replan
from nnscaler.cli.elastic.snapshot import SnapshotWriter

__all__ = ["Elastic", "nearest_plan_size", "replan", "resolved_snapshot_every"]

logger = logging.getLogger(__name__)

AGENT_FILE = "agent"
"""In a node's snapshot directory: the elastic agent whose workers wrote the snapshots."""

RESTARTS_KEY, REDONE_KEY = "elastic_restarts", "elastic_redone_steps"
"""train_status keys (saved with it): restarts so far and the steps they redid."""


class Elastic:
    """The Trainer's elastic state; inactive (every method a no-op) unless snapshots are on or the
    process runs under torchrun's agent."""

    def __init__(self) -> None:
        self.active = False
        self.writer: SnapshotWriter | None = None
        self.restored: tuple[str, int, int] | None = None
        """(source, step resumed from, newest step reached before the restart) after a restart."""

    @classmethod
    def prepare(cls, trainer: Any) -> Elastic:
        """Before compiling: after a restart, re-plan for the new world and point the resume at the newest
        complete snapshot (else the last disk checkpoint); on a fresh start, clear old snapshots."""
        self = cls()
        args = trainer.train_args
        every = resolved_snapshot_every(args.snapshot_every)
        if args.compile_mode or not (every or _max_restarts() > 0):  # nothing will restart from here
            return self
        self.active = True
        world = trainer.world_size
        group = dist.new_group(backend="gloo") if world > 1 else None
        member = membership(trainer.rank, world)
        root = snapshot_root(args.snapshot_dir, member.run_id)
        restarts = _max_over_ranks(member.restart_count, group)
        rejoined = _max_over_ranks(int(_same_agent(root) and bool(store.inventory(root))), group) > 0
        _warn_shared_store(trainer.rank)
        what = "resume"
        if restarts or rejoined:  # a failure (counted), or a node joined or left (not counted)
            what = f"elastic restart {restarts}" if restarts else "elastic re-rendezvous"
            trainer.train_args, line = replan(args, world)
            if line:
                say(trainer.rank, f"{what}: {line}")
            if trainer.train_args.gen_reuse == "match":  # an earlier round may have generated another world's
                trainer.train_args.gen_reuse = "moo"
        resume = args.checkpoint.resume_from
        asked = every > 0 and resume is not None and resume.checkpoint == "last"
        if restarts or rejoined or asked:
            self._point_resume(trainer, root, member, group, what)
        elif member.is_node_leader:
            store.clear(root)  # a fresh run: snapshots left under this run id are not ours
        if member.is_node_leader and (agent := agent_id()) is not None:
            root.mkdir(parents=True, exist_ok=True)
            store.write_atomic(root / AGENT_FILE, agent.encode())
        if group is not None:
            dist.barrier(group=group)
        auto = args.snapshot_every is None and every > 0
        self.writer = SnapshotWriter(every, root, member, group, auto=auto)
        return self

    def _point_resume(self, trainer: Any, root: Any, member: Membership, group: Any, what: str) -> None:
        found = restore.survey(root, member, group)
        step = found.complete_step()
        cfg = trainer.train_args.checkpoint
        disk = cfg.get_resume_checkpoint() if cfg.resume_from else None
        if disk is None and not cfg.no_save:
            cfg.resume_from, disk = ResumeOptions(checkpoint="last"), cfg.get_resume_checkpoint()
        disk_step = _disk_step(disk)
        if step is not None and step >= disk_step:
            lost = found.lost_ranks(step)
            old_world = next(iter(found.files(step).values()))["world_size"]
            path = restore.stage(root, step, found, member, group)
            cfg.resume_from = ResumeOptions(checkpoint=str(path))
            self.restored = ("in-memory snapshot", step, found.reached)
            say(
                trainer.rank,
                f"{what}: world {old_world} -> {member.world_size} ranks; "
                + (
                    f"lost ranks {lost} of node(s) {found.lost_nodes(step)} (their peer copies survive); "
                    if lost
                    else "no rank's memory lost; "
                )
                + f"newest complete snapshot: step {step}",
            )
        else:
            source = f"disk checkpoint {disk}" if disk is not None else "scratch (no checkpoint)"
            if disk is None:
                cfg.resume_from = None
            self.restored = (source, max(disk_step, 0), max(found.reached, disk_step))
            say(
                trainer.rank,
                f"{what}: no complete in-memory snapshot; resuming from {source}",
            )

    def after_resume(self, trainer: Any) -> None:
        """Count the restart and the steps it redoes (kept in train_status, so they add up over restarts)."""
        if self.restored is None:
            return
        source, _, reached = self.restored
        status = trainer.train_status
        step = status["step"]
        redone = max(0, reached - step)
        status[RESTARTS_KEY] = (status[RESTARTS_KEY] if RESTARTS_KEY in status else 0) + 1
        status[REDONE_KEY] = (status[REDONE_KEY] if REDONE_KEY in status else 0) + redone
        say(
            trainer.rank,
            f"elastic: resumed from {source} at step {step}; newest step reached before the restart: "
            f"{reached}; {redone} step(s) redone",
        )

    def after_step(self, trainer: Any) -> dict[str, float]:
        """At a step boundary: take a snapshot when due; the elastic metrics of the step."""
        if not self.active:
            return {}
        if self.writer is not None:
            self.writer.maybe_take(trainer)
        status = trainer.train_status
        return {
            "elastic/restarts": float(status[RESTARTS_KEY] if RESTARTS_KEY in status else 0),
            "elastic/redone_steps": float(status[REDONE_KEY] if REDONE_KEY in status else 0),
        }

    def finish(self) -> None:
        """Training ended normally: wait for the snapshot in flight, then free the node's memory."""
        w = self.writer
        if w is None:
            return
        w.wait()
        if w.group is not None:
            dist.barrier(group=w.group)
        if w.member.is_node_leader:
            store.clear(w.root)
            (w.root / AGENT_FILE).unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # left when it holds anything else
                w.root.rmdir()


def resolved_snapshot_every(value: int | None) -> int:
    """TrainerArgs.snapshot_every, with None: 1 under torchrun's elastic agent when it may restart the
    workers (--max-restarts above 0; the interval then adapts to the snapshots' cost), else 0 (nothing
    would restart from them)."""
    if value is not None:
        return value
    return 1 if _max_restarts() > 0 else 0


def _max_restarts() -> int:
    """torchrun's --max-restarts (0 outside torchrun)."""
    return env_vars.read("TORCHELASTIC_MAX_RESTARTS") or 0


def _warn_shared_store(rank: int) -> None:
    """torch's agent-shared TCP store keeps a failed round's keys: the restarted workers' process group
    then connects to dead addresses. TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (read by the agent) avoids it."""
    if _max_restarts() > 0 and env_vars.read("TORCHELASTIC_USE_AGENT_STORE"):
        say(
            rank,
            "warning: torchrun shares its rendezvous store with the workers, and a restarted round can fail "
            "to connect through it (it keeps the failed round's addresses): launch torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment (docs/elastic.md)",
        )


def _same_agent(root: Any) -> bool:
    """The node's snapshots were written under this worker's agent (before a join or a leave)."""
    agent = agent_id()
    try:
        return agent is not None and (root / AGENT_FILE).read_text() == agent
    except OSError:
        return False


def _max_over_ranks(value: int, group: Any) -> int:
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t)


def _disk_step(path: Any) -> int:
    """The step of a disk checkpoint directory (its complete.json), -1 without one."""
    if path is None:
        return -1
    try:
        return int(checkpoint_info(path).get("step", -1))
    except Exception:  # a merged file or an unreadable one: the resume path reports it
        return -1
