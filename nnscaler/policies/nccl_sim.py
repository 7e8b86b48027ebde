"""A model of NCCL point-to-point semantics that runs the P2P programs of `p2p_plan` and finds hangs.

The model (what gloo forgives and NCCL does not):
- one ordered stream per pair of ranks on each side: ops between a pair run in issue order;
- rendezvous: a send completes only together with its matching receive, and the k-th op on one
  side's stream must be the counterpart of the k-th op on the other (tags are ignored);
- a `Batch` (`dist.batch_isend_irecv`) is one stream item: its ops start together, and it matches
  a batch of the counterparts on the other side;
- the host never blocks on a send (isend); it blocks on `Wait` until that receive is done.
Messages from a group to itself (virtual stages on one group) complete at once.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from nnscaler.errors import PlanError
from nnscaler.policies.p2p_plan import Compute, Message, Post, Send, Step, Wait, group_program

__all__ = ["Batch", "simulate_nccl", "check_nccl"]


@dataclass(frozen=True)
class Batch:
    """Posts and sends with one peer issued together as one `batch_isend_irecv`."""

    ops: tuple[Post | Send, ...]


_Item = tuple[tuple[str, Message], ...]  # one stream item: ('send' | 'recv', message) ops


def _item(ops: Sequence[Post | Send]) -> _Item:
    return tuple(sorted(("send" if isinstance(o, Send) else "recv", o.msg) for o in ops))


def _counterpart(item: _Item) -> _Item:
    return tuple(sorted(("recv" if d == "send" else "send", m) for d, m in item))


def _show(item: _Item) -> str:
    return " + ".join(f"{d} {m}" for d, m in item)


def simulate_nccl(programs: Sequence[Sequence[Step | Batch]]) -> None:
    """Run one program per device group under the NCCL model; raise PlanError on a hang or mismatch."""
    n = len(programs)
    pos = [0] * n
    done: list[set[Message]] = [set() for _ in range(n)]
    queues: dict[tuple[int, int], deque[_Item]] = {}
    matched: dict[tuple[int, int], int] = {}

    def issue(g: int, ops: Sequence[Post | Send]) -> None:
        peers = {o.peer for o in ops}
        if len(peers) != 1:
            raise PlanError(f"device group {g} batches P2P ops with several peers {sorted(peers)}")
        peer = peers.pop()
        if peer == g:
            done[g].update(o.msg for o in ops if isinstance(o, Send))
            return
        queues.setdefault((g, peer), deque()).append(_item(ops))

    def run_host(g: int) -> bool:
        moved = False
        while pos[g] < len(programs[g]):
            step = programs[g][pos[g]]
            if isinstance(step, Wait) and step.msg not in done[g]:
                break
            if isinstance(step, (Post, Send)):
                issue(g, [step])
            elif isinstance(step, Batch):
                issue(g, step.ops)
            pos[g] += 1
            moved = True
        return moved

    def run_pair(a: int, b: int) -> bool:
        qa, qb = queues.get((a, b)), queues.get((b, a))
        moved = False
        while qa and qb:
            k = matched.get((a, b), 0)
            if all(d == "send" for d, _ in qa[0] + qb[0]):
                raise PlanError(
                    f"P2P deadlock under NCCL semantics (rendezvous sends): at op {k} of the pair, group {a} "
                    f"sends [{_show(qa[0])}] and group {b} sends [{_show(qb[0])}], each waiting for a receive the "
                    "other posts only after its own send: post the receives first or batch them with the sends"
                )
            if _counterpart(qa[0]) != qb[0]:
                raise PlanError(
                    f"NCCL P2P order mismatch between device groups {a} and {b} at op {k}: group {a} issues "
                    f"[{_show(qa[0])}] while group {b} issues [{_show(qb[0])}] (NCCL matches the k-th ops of a "
                    "pair in order and ignores tags: this hangs, or silently swaps data of equal size)"
                )
            for d, m in qa.popleft():
                if d == "recv":
                    done[a].add(m)
            for d, m in qb.popleft():
                if d == "recv":
                    done[b].add(m)
            matched[(a, b)] = k + 1
            moved = True
        return moved

    while True:
        moved = any([run_host(g) for g in range(n)])
        moved = any([run_pair(a, b) for a in range(n) for b in range(a + 1, n)]) or moved
        if not moved:
            break
    stuck = {g: programs[g][pos[g]] for g in range(n) if pos[g] < len(programs[g])}
    heads = {k: _show(q[0]) for k, q in sorted(queues.items()) if q}
    if stuck or heads:
        waits = "; ".join(f"group {g} waits at {_describe(s)}" for g, s in stuck.items()) or "no host waits"
        streams = "; ".join(f"{a}->{b} stream blocked at [{h}]" for (a, b), h in heads.items())
        raise PlanError(f"P2P deadlock under NCCL semantics (rendezvous sends): {waits}; {streams}")


def _describe(step: Step | Batch) -> str:
    if isinstance(step, Wait):
        return f"receive of {step.msg} from group {step.peer}"
    if isinstance(step, Compute):
        return f"{step.action}"
    return repr(step)


def check_nccl(scheduler: str, nstages: int, pp_size: int, nmicros: int) -> None:
    """Raise PlanError when the executor's P2P program of this schedule would hang on NCCL."""
    for train in (True, False):
        programs = [group_program(scheduler, nstages, pp_size, nmicros, g, train) for g in range(pp_size)]
        try:
            simulate_nccl(programs)
        except PlanError as e:
            step = "train_step" if train else "infer_step"
            raise PlanError(
                f"pipeline schedule {scheduler!r} with {nstages} stages on {pp_size} device groups and "
                f"{nmicros} micro-batches would hang on NCCL in {step}: {e}"
            ) from e
