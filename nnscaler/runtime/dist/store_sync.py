"""Signals between ranks through the default process group's store, outside any collective.

A collective that a peer never joins either hangs or fails with a message that says nothing about
the peer. The c10d store that every process group is built on (a TCPStore under torchrun, hosted by
rank 0 or the elastic agent; a FileStore in tests) answers key look-ups without the peers taking
part, so it can carry what a collective cannot:

- `publish_outcome` / `wait_outcome`: one rank (rank 0 after compiling in `parallelize`) says
  whether it succeeded and, if not, its error (type, message, last lines of its traceback); the
  others poll the key with their own deadline (no collective timeout applies) and notice within a
  moment when the store's host died (a look-up fails once its server is gone).
- `reach`: "every rank of this group has reached point X": each rank sets its arrival key and waits
  for the others' for a bounded time, then raises on the ranks that came, naming those that did not.

Keys are numbered by how often this process used them (`next_key`): the n-th `parallelize` or the
n-th ZeRO-3 `state_dict()` of one rank meets the n-th of the others, as long as every rank makes the
same calls in the same order (which collectives need anyway). After one of these errors the numbers
of the ranks may differ, so restart the job rather than going on.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch.distributed as dist

from nnscaler.errors import NnScalerError
from nnscaler.runtime.dist.timeouts import arrival_timeout, as_timedelta

__all__ = ["PeerError", "Outcome", "default_store", "next_key", "publish_outcome", "wait_outcome", "reach"]

logger = logging.getLogger(__name__)

TRACEBACK_LINES = 20
"""Lines of the failing rank's traceback that the other ranks show."""

MAX_TEXT = 8000
"""Characters of the message and of the traceback kept each (a store value stays small)."""

PROGRESS_EVERY = 300.0
"""Seconds between 'still waiting' log lines (logger nnscaler.runtime.dist.store_sync, level INFO)."""

_counts: dict[str, int] = {}


class PeerError(NnScalerError, RuntimeError):
    """Another rank failed, died, or did not reach the point this rank reached; the message says which."""


@dataclass(frozen=True)
class Outcome:
    """What a rank publishes about a step the others wait for (ok, or its error)."""

    ok: bool
    error_type: str = ""
    message: str = ""
    traceback: str = ""
    """The last `TRACEBACK_LINES` lines of the formatted traceback."""

    @classmethod
    def of(cls, error: BaseException | None) -> Outcome:
        if error is None:
            return cls(ok=True)
        lines = "".join(traceback.format_exception(type(error), error, error.__traceback__)).splitlines()
        return cls(
            ok=False,
            error_type=type(error).__qualname__,
            message=str(error)[:MAX_TEXT],
            traceback="\n".join(lines[-TRACEBACK_LINES:])[-MAX_TEXT:],
        )

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> Outcome:
        return cls(**json.loads(bytes(data).decode()))


def default_store() -> dist.Store:
    """The store of the default process group (RuntimeError naming the fix if there is none)."""
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("no default process group: call nnscaler.init() (under torchrun) first")
    return dist.distributed_c10d._get_default_store()  # no public accessor as of torch 2.13


def next_key(name: str) -> str:
    """`nnscaler/<name>/<n>` for the n-th call with `name` in this process (n from 1)."""
    _counts[name] = _counts.get(name, 0) + 1
    return f"nnscaler/{name}/{_counts[name]}"


def publish_outcome(key: str, error: BaseException | None, store: dist.Store | None = None) -> None:
    """Make `error` (or success, when None) readable under `key` by every rank."""
    (store or default_store()).set(key, Outcome.of(error).to_bytes())


def _lost(me: int, src: int, what: str, exc: BaseException) -> PeerError:
    return PeerError(
        f"rank {me}: lost contact with the process-group store while waiting for rank {src} to {what} "
        f"({type(exc).__name__}: {exc}); rank {src} (or the launcher hosting the store) probably died: "
        "see its log for the cause"
    )


def wait_outcome(
    key: str,
    *,
    src: int,
    what: str,
    timeout: datetime.timedelta | float,
    store: dist.Store | None = None,
    me: int | None = None,
) -> None:
    """Wait until rank `src` publishes under `key`; raise `PeerError` with its error if it failed.

    `what` completes "waiting for rank {src} to ...". Polls (no collective, so the process-group
    timeout does not apply); raises `PeerError` after `timeout` or as soon as the store is unreachable.
    """
    store = store or default_store()
    me = dist.get_rank() if me is None else me
    limit = as_timedelta(timeout, "timeout").total_seconds()
    start = time.monotonic()
    delay, next_note = 0.002, start + PROGRESS_EVERY
    while True:
        try:
            if store.check([key]):
                data = store.get(key)
                break
        except RuntimeError as exc:  # DistNetworkError (a RuntimeError): the store's server is gone
            raise _lost(me, src, what, exc) from exc
        now = time.monotonic()
        if now - start > limit:
            raise PeerError(
                f"rank {me}: rank {src} did not {what} within {limit:.0f} s; if it is merely slow, set "
                "NNSCALER_COMPILE_TIMEOUT (seconds) higher on every rank"
            )
        if now > next_note:
            logger.info("rank %d: still waiting for rank %d to %s (%.0f s)", me, src, what, now - start)
            next_note = now + PROGRESS_EVERY
        time.sleep(delay)
        delay = min(delay * 2, 0.25)
    outcome = Outcome.from_bytes(data)
    if not outcome.ok:
        raise PeerError(
            f"rank {me}: rank {src} could not {what}: {outcome.error_type}: {outcome.message}\n"
            f"rank {src}'s traceback (last lines):\n{outcome.traceback}"
        )


def _ranks(group: dist.ProcessGroup | None) -> list[int]:
    if group is None:
        return list(range(dist.get_world_size()))
    return sorted(dist.get_process_group_ranks(group))


def reach(
    point: str,
    group: dist.ProcessGroup | None = None,
    *,
    timeout: datetime.timedelta | float | None = None,
    hint: str = "",
    store: dist.Store | None = None,
) -> None:
    """Return once every rank of `group` (default: the world) has called `reach` with `point`.

    Call it on every rank of the group before the first collective of an operation that a user could
    call on some ranks only. Raises `PeerError` on the ranks that came when the others have not come
    within `timeout` (default `arrival_timeout(group)`), naming them; `hint` (how to fix it) ends the
    message. A no-op without a process group or with a group of one rank.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    ranks = _ranks(group)
    if len(ranks) <= 1:
        return
    store = store or default_store()
    wait = as_timedelta(timeout, "timeout") if timeout is not None else arrival_timeout(group)
    me = dist.get_rank()
    base = f"reach/{point}/{'.'.join(map(str, ranks))}"
    key = next_key(base)
    number = _counts[base]
    keys = [f"{key}/{r}" for r in ranks]
    store.set(f"{key}/{me}", b"1")
    try:
        store.wait(keys, wait)
    except RuntimeError as exc:
        if isinstance(exc, getattr(dist, "DistNetworkError", ())):
            raise _lost(me, ranks[0], f"reach {point}", exc) from exc
        try:
            missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        except RuntimeError as again:
            raise _lost(me, ranks[0], f"reach {point}", again) from again
        if missing:
            came = [r for r in ranks if r not in missing]
            raise PeerError(
                f"rank {me}: rank(s) {_names(missing)} did not reach {point} within "
                f"{wait.total_seconds():g} s (call #{number} on this rank; rank(s) {_names(came)} came). "
                f"{hint + ' ' if hint else ''}(NNSCALER_ARRIVAL_TIMEOUT sets how many seconds to wait.)"
            ) from None
    if number > 2:  # every rank is past call number-2 (they all arrived at number-1): drop our key
        try:
            store.delete_key(f"nnscaler/{base}/{number - 2}/{me}")
        except RuntimeError:
            pass


def _names(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks))
