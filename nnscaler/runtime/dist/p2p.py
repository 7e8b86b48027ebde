"""Point-to-point sends and receives of the pipeline executor, with an NCCL-like strict mode for gloo.

Ops carry no tags (NCCL ignores them): between two ranks, the k-th op on one side meets the k-th on
the other, so both sides must issue them in the same order (the generated `_train_step` does, see
nnscaler/policies/p2p_plan.py). gloo matches untagged ops in order too, but buffers every send, so
a wrong order that would hang on NCCL may run on gloo, or swap two tensors of equal size silently.

`NNSCALER_STRICT_P2P=1` makes such orders fail on gloo:
- every send is waited at once; gloo's tcp transport hands data over only once the receiver has
  posted the matching receive, so this is a rendezvous send, as on NCCL (stricter: it also blocks
  the host). A send not received within NNSCALER_STRICT_P2P_TIMEOUT seconds (default 60) raises
  P2POrderError naming the pair, the position and the op (NCCL would hang there);
- every tensor goes with a header (the sender's op position in the pair, and which tensor it is)
  that the receiver checks against its own position and expectation, raising P2POrderError naming
  the pair, the position and both ops.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from nnscaler import env_vars
from nnscaler.errors import NnScalerError

__all__ = ["Label", "P2P", "P2POrderError", "connect", "strict_p2p"]

STRICT_ENV = "NNSCALER_STRICT_P2P"
TIMEOUT_ENV = "NNSCALER_STRICT_P2P_TIMEOUT"
"""Seconds a strict send waits for the peer to post its receive (default 60) before P2POrderError."""


def strict_p2p() -> bool:
    """Whether `NNSCALER_STRICT_P2P=1` is set (checked P2P order, synchronous sends)."""
    return bool(env_vars.read(STRICT_ENV))  # 1/0, true/false, yes/no, on/off; else ConfigError


class P2POrderError(NnScalerError, RuntimeError):
    """Two ranks issued their point-to-point ops in different orders (a hang or swapped data on NCCL)."""


@dataclass(frozen=True)
class Label:
    """Which tensor a P2P op carries: activations ('F') or gradients ('B') into/of `stage`."""

    kind: str
    stage: int
    micro: int
    index: int

    def __str__(self) -> str:
        what = "activation" if self.kind == "F" else "gradient"
        return f"{what} {self.index} of stage {self.stage} micro-batch {self.micro}"


_HEADER = 6  # position, kind, stage, micro, index, numel


def _header(pos: int, label: Label, numel: int, device: torch.device) -> torch.Tensor:
    values = [pos, 0 if label.kind == "F" else 1, label.stage, label.micro, label.index, numel]
    return torch.tensor(values, dtype=torch.int64, device=device)


def _describe(header: list[int]) -> str:
    pos, kind, stage, micro, index, numel = header
    label = Label("F" if kind == 0 else "B", stage, micro, index)
    return f"op {pos}: send of {label} ({numel} elements)"


class _CheckedRecv:
    """A receive whose header is checked when it is waited on."""

    def __init__(self, works: list, header: torch.Tensor, want: list[int], src: int, label: Label) -> None:
        self.works, self.header, self.want, self.src, self.label = works, header, want, src, label

    def wait(self) -> None:
        self.works[0].wait()
        got = self.header.tolist()
        if got != self.want:
            me = dist.get_rank()
            raise P2POrderError(
                f"P2P order mismatch between ranks {self.src} and {me} at op {self.want[0]}: rank {me} received "
                f"as its op {self.want[0]} with rank {self.src} the {self.label} ({self.want[5]} elements), but "
                f"rank {self.src} issued {_describe(got)}. On NCCL this hangs or swaps data: both ranks must issue "
                "their sends and receives with each other in the same order (see docs/pipeline.md, P2P order)"
            )
        self.works[1].wait()


class P2P:
    """This rank's point-to-point ops of one step; strict (checked, synchronous) under NNSCALER_STRICT_P2P."""

    def __init__(self, device: torch.device, strict: bool | None = None) -> None:
        self.device = device
        self.strict = strict_p2p() if strict is None else strict
        self._pos: dict[int, int] = {}
        self._pending: list[tuple[object, torch.Tensor]] = []

    def _next(self, peer: int) -> int:
        pos = self._pos.get(peer, 0)
        self._pos[peer] = pos + 1
        return pos

    def send(self, t: torch.Tensor, dst: int, label: Label) -> None:
        """Send `t` (asynchronous; waited by `finish`, or at once in strict mode)."""
        pos = self._next(dst)
        if not self.strict:
            self._pending.append((dist.isend(t, dst), t))
            return
        header = _header(pos, label, t.numel(), t.device)
        self._wait_sent(dist.isend(header, dst), dst, pos, label)
        self._wait_sent(dist.isend(t, dst), dst, pos, label)

    def _wait_sent(self, work, dst: int, pos: int, label: Label) -> None:
        seconds = env_vars.read(TIMEOUT_ENV) or 60.0
        try:
            ok = work.wait(timedelta(seconds=seconds))
        except RuntimeError as e:
            ok, cause = False, e
        else:
            cause = None
        if ok is False:
            me = dist.get_rank()
            raise P2POrderError(
                f"rank {me}'s send of {label} to rank {dst} (op {pos} of the pair {me}-{dst}) was not received "
                f"within {seconds:g} s ({TIMEOUT_ENV}): rank {dst} did not post the matching receive, so on NCCL "
                "this send hangs. Both ranks must issue their sends and receives with each other in the same "
                "order (see docs/pipeline.md, P2P order)"
            ) from cause

    def recv(self, t: torch.Tensor, src: int, label: Label):
        """Post the receive of `t`; returns a work handle to wait on."""
        pos = self._next(src)
        if not self.strict:
            return dist.irecv(t, src)
        header = torch.empty(_HEADER, dtype=torch.int64, device=t.device)
        works = [dist.irecv(header, src), dist.irecv(t, src)]
        want = _header(pos, label, t.numel(), t.device).tolist()
        return _CheckedRecv(works, header, want, src, label)

    def finish(self) -> None:
        """Wait for every send."""
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()


_connected: set[tuple[int, int, int]] = set()
"""(process group id, rank, peer) pairs already connected in this process."""


def connect(peers: Sequence[int], device: torch.device) -> None:
    """Exchange one tiny message with each peer not yet connected, pairs in one global order.

    NCCL creates a pair's communicator at the pair's first P2P op, blocking until both ranks reach
    it. The schedule's first ops could close a cycle (in the interleaved schedule, device group 0's
    first op is a receive from the last group, which waits for the others); connecting every pair
    first, each rank taking its pairs in increasing (low rank, high rank) order, cannot.
    """
    if not dist.is_initialized():
        return
    me, pg = dist.get_rank(), id(dist.group.WORLD)
    todo = sorted((min(me, p), max(me, p)) for p in set(peers) if p != me and (pg, me, p) not in _connected)
    for low, high in todo:
        peer = high if low == me else low
        out, got = torch.zeros(1, device=device), torch.empty(1, device=device)
        # P2POp accepts only torch's own isend / irecv: unwrap the timeline's recording wrappers
        isend, irecv = (getattr(f, "__wrapped__", f) for f in (dist.isend, dist.irecv))
        ops = [dist.P2POp(isend, out, peer), dist.P2POp(irecv, got, peer)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        _connected.add((pg, me, peer))
