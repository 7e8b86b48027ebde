"""The P2P program of context-parallel attention's ring, checked at plan time under NCCL's rules.

Each attention call on a ring of n devices (kinds 'ring' and 'zigzag' over the whole cp group,
'hybrid' over its ring groups; 'ulysses' uses all-to-alls only) runs, on ring position p:
- forward: n - 1 exchanges, step t: send the K/V block held to p + 1, receive the next from p - 1;
- backward: for t = 0 .. n - 1: a K/V exchange (t < n - 1), then a dK/dV exchange (the accumulator
  of the block held travels on with it).
Each exchange is one `batch_isend_irecv` [send to p + 1, recv from p - 1]: with two devices both go
to one peer in one batch (unbatched, both would send first and wait under rendezvous semantics);
with more they are separate pair streams, the receive posted before the host waits. The runtime
kernels (nnscaler.runtime.context_parallel.schedule) follow the same description: a test compares them.
Calls run in program order: every layer's forward, then the backwards in reverse.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from nnscaler.errors import PlanError
from nnscaler.policies.nccl_sim import Batch, simulate_nccl
from nnscaler.policies.p2p_plan import Post, Send, Wait

__all__ = ["RingMessage", "ring_exchanges", "ring_programs", "check_ring_nccl"]


@dataclass(frozen=True, order=True)
class RingMessage:
    """One block a ring position sends on: of attention call `call`, exchange `index` of its phase."""

    call: int
    phase: str
    index: int
    payload: str
    src: int

    def __str__(self) -> str:
        what = "K/V block" if self.payload == "kv" else "dK/dV accumulator"
        return f"{what} of attention call {self.call} ({self.phase} exchange {self.index}) from position {self.src}"


def ring_exchanges(n: int) -> list[tuple[str, str]]:
    """(phase, payload) of one attention call's exchanges, in order."""
    if n <= 1:
        return []
    forward = [("forward", "kv")] * (n - 1)
    backward: list[tuple[str, str]] = []
    for t in range(n):
        backward += ([("backward", "kv")] if t < n - 1 else []) + [("backward", "dkv")]
    return forward + backward


def _exchange(call: int, phase: str, index: int, payload: str, n: int, p: int) -> list:
    nxt, prev = (p + 1) % n, (p - 1) % n
    out = RingMessage(call, phase, index, payload, p)
    inc = RingMessage(call, phase, index, payload, prev)
    if nxt == prev:
        return [Batch((Send(out, nxt), Post(inc, prev))), Wait(inc, prev)]
    return [Send(out, nxt), Post(inc, prev), Wait(inc, prev)]


def ring_programs(n: int, calls: int) -> list[list]:
    """Every ring position's P2P program for `calls` attention calls (forwards, then backwards)."""
    programs: list[list] = [[] for _ in range(n)]
    order = [(c, "forward") for c in range(calls)] + [(c, "backward") for c in reversed(range(calls))]
    for call, phase in order:
        index = 0
        for ph, payload in ring_exchanges(n):
            if ph != phase:
                continue
            for p in range(n):
                programs[p] += _exchange(call, phase, index, payload, n, p)
            index += 1
    return programs


def check_ring_nccl(n: int, calls: int, programs: list[list] | None = None) -> None:
    """Raise PlanError when the ring's P2P program (or the one given) would hang on NCCL."""
    if programs is None:
        _check_ring(n, calls)
        return
    _simulate(n, calls, programs)


@lru_cache(maxsize=256)
def _check_ring(n: int, calls: int) -> None:
    _simulate(n, calls, ring_programs(n, calls))


def _simulate(n: int, calls: int, programs: list[list]) -> None:
    try:
        simulate_nccl(programs)
    except PlanError as e:
        raise PlanError(
            f"context-parallel ring over {n} devices ({calls} attention calls) would hang on NCCL: {e}"
        ) from e
