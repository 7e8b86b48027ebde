"""The ring's point-to-point order, as data: the ring kernels issue exactly these batches (one
`dist.batch_isend_irecv` call each, in this order), and `ring_p2p_steps` lays them out per rank
for the compiler's plan-time NCCL simulator.

One attention call on a ring of n positions issues:
- forward: n-1 batches, `kv` step t = 0..n-2: send the K/V block now held to the next position,
  receive the next one from the previous position (posted before computing step t);
- backward: for t = 0..n-1, a `kv` batch (t < n-1, posted before computing step t) and then a
  `dkv` batch (after computing step t: the dK/dV accumulator of the block held travels to the next
  position; after the last one every accumulator is back at its block's owner).
Every batch is [send to (pos+1) % n, recv from (pos-1) % n]. The all-to-alls of the zigzag reorder
and of Ulysses are collectives (same order on every rank of their group), not listed here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CP_KINDS", "RingBatch", "forward_batches", "backward_batches", "ring_p2p_steps", "PHASES"]

CP_KINDS = ("zigzag", "ring", "ulysses", "hybrid")
"""The context-parallel attention kinds `context_parallel_attention` accepts."""
PHASES = ("forward", "backward", "both")


@dataclass(frozen=True)
class RingBatch:
    """One `batch_isend_irecv` call of the ring."""

    phase: str
    """"forward" or "backward"."""
    payload: str
    """"kv" (a K/V block) or "dkv" (a dK/dV accumulator)."""
    step: int
    """The ring step it belongs to (kv: the step whose compute it overlaps; dkv: the step it follows)."""
    ops: tuple[tuple[str, int], ...]
    """(op, peer position in the ring): "send" or "recv", in the order they are posted."""


def _ops(n: int, pos: int) -> tuple[tuple[str, int], ...]:
    return (("send", (pos + 1) % n), ("recv", (pos - 1) % n))


def forward_batches(n: int, pos: int) -> list[RingBatch]:
    """The forward's batches for ring position `pos` of `n`."""
    return [RingBatch("forward", "kv", t, _ops(n, pos)) for t in range(n - 1)] if n > 1 else []


def backward_batches(n: int, pos: int) -> list[RingBatch]:
    """The backward's batches for ring position `pos` of `n`."""
    if n <= 1:
        return []
    out = []
    for t in range(n):
        if t < n - 1:
            out.append(RingBatch("backward", "kv", t, _ops(n, pos)))
        out.append(RingBatch("backward", "dkv", t, _ops(n, pos)))
    return out


def _ring_shape(n: int, kind: str, ulysses_size: int) -> tuple[int, int]:
    """(ring size, stride between ring neighbours in group positions) of one attention call."""
    if kind not in CP_KINDS:
        raise ValueError(f"kind must be one of {CP_KINDS}, got {kind!r}")
    if kind == "ulysses":
        return 1, 1
    if kind != "hybrid":
        return n, 1
    if ulysses_size < 1 or n % ulysses_size != 0:
        raise ValueError(f"ulysses_size={ulysses_size} must divide the group size {n}")
    return n // ulysses_size, ulysses_size


def ring_p2p_steps(
    n: int, kind: str, ulysses_size: int = 1, phase: str = "both"
) -> list[list[tuple[str, int, int]]]:
    """Per position in the attention's group (n ranks), its P2P ops in program order, as
    (op, peer position in the group, step) with op "send" / "recv" and step the index of the
    `batch_isend_irecv` call that issues it (forward calls first, then backward for "both").

    The order does not depend on causality. "ulysses" and n = 1 issue none. "hybrid" rings run
    over the positions with the same index inside their inner group (stride `ulysses_size`).
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    r, stride = _ring_shape(n, kind, ulysses_size)
    out: list[list[tuple[str, int, int]]] = []
    for p in range(n):
        i, j = divmod(p, stride)
        batches = []
        if phase in ("forward", "both"):
            batches += forward_batches(r, i)
        if phase in ("backward", "both"):
            batches += backward_batches(r, i)
        out.append([(op, peer * stride + j, step) for step, b in enumerate(batches) for op, peer in b.ops])
    return out
