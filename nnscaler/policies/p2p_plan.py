"""The point-to-point program of each pipeline device group: when it posts receives, sends, waits.

NCCL ignores tags and runs all P2P between two ranks on one ordered stream, where a send may wait
for its matching receive (rendezvous). So both ranks of a pair must issue their ops in one agreed
order: the k-th op on one side is the counterpart of the k-th on the other. The agreed order of a
pair is its messages sorted by when a buffered run of the schedule sends them (`pair_sequences`).
Each group then issues its ops in that order (`group_program`): a send when its stage produces it,
and every receive as early as the order allows (right after the op before it is issued), waiting on
it only just before use. Receives posted early are Megatron's `send_forward_recv_backward` pairs.
`nnscaler/policies/nccl_sim.py` checks the result cannot hang.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

from nnscaler.errors import PlanError
from nnscaler.policies.pipeline_actions import stage_group
from nnscaler.policies.schedules import Action, forward_order, group_actions

__all__ = [
    "Message",
    "Compute",
    "Post",
    "Send",
    "Wait",
    "Step",
    "pair_sequences",
    "group_program",
    "unpaired_program",
]


@dataclass(frozen=True, order=True)
class Message:
    """What one stage passes another for one micro-batch: 'F' (outputs of `stage`, to stage + 1) or
    'B' (gradients of the inputs of `stage`, to stage - 1)."""

    kind: str
    stage: int
    micro: int

    def src(self, place: int | Callable[[int], int]) -> int:
        """The sending group; `place`: pp_size (stage s on group s % pp_size) or stage -> group."""
        return _group(place, self.stage)

    def dst(self, place: int | Callable[[int], int]) -> int:
        return _group(place, self.stage + (1 if self.kind == "F" else -1))

    def __str__(self) -> str:
        what = "activations" if self.kind == "F" else "gradients"
        return f"{what} of stage {self.stage} micro-batch {self.micro}"


def _group(place: int | Callable[[int], int], stage: int) -> int:
    return place(stage) if callable(place) else stage % place


def _placement(scheduler: str, pp_size: int) -> Callable[[int], int]:
    return lambda stage: stage_group(scheduler, stage, pp_size)


@dataclass(frozen=True)
class Compute:
    """Run a forward / backward (it first waits on the receives it uses: see Wait)."""

    action: Action


@dataclass(frozen=True)
class Post:
    """Post the receive of `msg` from `peer` (asynchronous)."""

    msg: Message
    peer: int


@dataclass(frozen=True)
class Send:
    """Send `msg` to `peer` (asynchronous)."""

    msg: Message
    peer: int


@dataclass(frozen=True)
class Wait:
    """Block until the posted receive of `msg` from `peer` is done."""

    msg: Message
    peer: int


Step = Compute | Post | Send | Wait


def _orders(scheduler: str, nstages: int, pp_size: int, nmicros: int, train: bool) -> list[list[Action]]:
    get = group_actions if train else forward_order
    return [get(scheduler, nstages, pp_size, nmicros, g) for g in range(pp_size)]


def _needs(a: Action, nstages: int) -> Message | None:
    """The message action `a` receives, if any (a W receives nothing)."""
    if a.kind == "W":
        return None
    if a.kind == "F":
        return Message("F", a.stage - 1, a.micro) if a.stage > 0 else None
    return Message("B", a.stage + 1, a.micro) if a.stage + 1 < nstages else None


def _makes(a: Action, nstages: int, train: bool) -> Message | None:
    """The message action `a` sends, if any."""
    if a.kind == "W":
        return None
    if a.kind == "F":
        return Message("F", a.stage, a.micro) if a.stage + 1 < nstages else None
    return Message("B", a.stage, a.micro) if a.stage > 0 and train else None


def _send_times(orders: list[list[Action]], nstages: int, train: bool) -> dict[Message, Fraction]:
    """When each message is sent in a run with buffered sends and exact unit costs (F 1, B 2; a B split
    off its W 1, the W 1)."""
    chunks = max(1, nstages // len(orders))
    split = {(a.stage, a.micro) for order in orders for a in order if a.kind == "W"}
    done: dict[Action, Fraction] = {}
    sent: dict[Message, Fraction] = {}
    pos = [0] * len(orders)
    clock = [Fraction(0)] * len(orders)
    while any(p < len(o) for p, o in zip(pos, orders)):
        progressed = False
        for g, order in enumerate(orders):
            while pos[g] < len(order):
                a = order[pos[g]]
                need = _needs(a, nstages)
                deps = [] if need is None else [Action(need.kind, need.stage, need.micro)]
                if a.kind == "B":
                    deps.append(Action("F", a.stage, a.micro))
                if a.kind == "W":
                    deps.append(Action("B", a.stage, a.micro))
                if any(d not in done for d in deps):
                    break
                start = max([clock[g]] + [done[d] for d in deps])
                cost = 2 if a.kind == "B" and (a.stage, a.micro) not in split else 1
                clock[g] = done[a] = start + Fraction(cost, chunks)
                made = _makes(a, nstages, train)
                if made is not None:
                    sent[made] = clock[g]
                pos[g] += 1
                progressed = True
        if not progressed:
            stuck = {g: orders[g][pos[g]] for g in range(len(orders)) if pos[g] < len(orders[g])}
            raise PlanError(
                f"pipeline schedule deadlocks even with buffered sends: device groups wait on {stuck}"
            )
    return sent


@lru_cache(maxsize=64)
def pair_sequences(
    scheduler: str, nstages: int, pp_size: int, nmicros: int, train: bool = True
) -> dict[tuple[int, int], list[Message]]:
    """(group a, group b) with a < b -> their messages in the order both must issue them (cached: do not
    modify the result)."""
    sent = _send_times(_orders(scheduler, nstages, pp_size, nmicros, train), nstages, train)
    place = _placement(scheduler, pp_size)
    out: dict[tuple[int, int], list[Message]] = {}
    for msg in sorted(sent, key=lambda m: (sent[m], m.src(place), m)):
        a, b = sorted((msg.src(place), msg.dst(place)))
        if a == b:  # a virtual stage feeding the next on the same group: no P2P pair
            continue
        out.setdefault((a, b), []).append(msg)
    return out


def group_program(
    scheduler: str, nstages: int, pp_size: int, nmicros: int, group: int, train: bool = True
) -> list[Step]:
    """Device group `group`'s steps, P2P in the agreed order of each pair, receives posted early."""
    seqs = pair_sequences(scheduler, nstages, pp_size, nmicros, train)
    place = _placement(scheduler, pp_size)
    mine = {(b if a == group else a): seq for (a, b), seq in seqs.items() if group in (a, b)}
    nxt = dict.fromkeys(mine, 0)
    posted: set[Message] = set()
    steps: list[Step] = []

    def post_ready(peer: int) -> None:
        seq = mine[peer]
        while nxt[peer] < len(seq) and seq[nxt[peer]].dst(place) == group:
            steps.append(Post(seq[nxt[peer]], peer))
            posted.add(seq[nxt[peer]])
            nxt[peer] += 1

    for peer in sorted(mine):
        post_ready(peer)
    for a in _orders(scheduler, nstages, pp_size, nmicros, train)[group]:
        need = _needs(a, nstages)
        if need is not None:
            if need not in posted:  # cannot happen with the time order: a bug in pair_sequences
                raise PlanError(
                    f"P2P order: device group {group} needs {need} before the order lets it post it"
                )
            steps.append(Wait(need, need.src(place)))
        steps.append(Compute(a))
        made = _makes(a, nstages, train)
        if made is not None:
            peer = made.dst(place)
            if peer == group:  # to itself: posted right before the send
                steps += [Post(made, peer), Send(made, peer)]
                posted.add(made)
                continue
            if mine[peer][nxt[peer]] != made:
                raise PlanError(
                    f"P2P order: device group {group} sends {made} but the order with group {peer} has "
                    f"{mine[peer][nxt[peer]]} next"
                )
            steps.append(Send(made, peer))
            nxt[peer] += 1
            post_ready(peer)
    return steps


def unpaired_program(
    scheduler: str, nstages: int, pp_size: int, nmicros: int, group: int, train: bool = True
) -> list[Step]:
    """The naive program (before NCCL ordering): send when made, post each receive just before use."""
    steps: list[Step] = []
    place = _placement(scheduler, pp_size)
    for a in _orders(scheduler, nstages, pp_size, nmicros, train)[group]:
        need = _needs(a, nstages)
        if need is not None:
            steps += [Post(need, need.src(place)), Wait(need, need.src(place))]
        steps.append(Compute(a))
        made = _makes(a, nstages, train)
        if made is not None:
            steps.append(Send(made, made.dst(place)))
    return steps


def messages_of(steps: Sequence[Step]) -> list[Message]:
    """The messages a program sends or receives, in issue order (for tests and errors)."""
    return [s.msg for s in steps if isinstance(s, (Post, Send))]
