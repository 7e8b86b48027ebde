"""Noticing a rank that died: heartbeats through the process-group store, outside any collective.

Each rank's `Heartbeat` thread increments `nnscaler/trainer/heartbeat/{rank}` in the c10d store
every `interval` seconds. When a collective of the training loop fails (gloo raises as soon as a
peer's connection closes), `diagnose` watches the counters for a few intervals: ranks whose counter
stands still are dead, ranks that published an error (`publish_failure`) failed with that error,
and the raised `PeerError` names them. If instead the loop is stuck (a collective that never
returns), the thread itself notices a peer silent for `NNSCALER_HEARTBEAT_TIMEOUT` seconds (default
30), prints the same message and ends the process with exit status 1: the main thread cannot be
interrupted inside a C++ collective.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch.distributed as dist

from nnscaler import env_vars
from nnscaler.runtime.dist.store_sync import Outcome, PeerError, default_store

__all__ = ["Heartbeat", "heartbeat_timeout"]

PREFIX = "nnscaler/trainer"


def heartbeat_timeout() -> float:
    """$NNSCALER_HEARTBEAT_TIMEOUT seconds (default 30): a peer silent this long is dead."""
    return env_vars.read("NNSCALER_HEARTBEAT_TIMEOUT") or 30.0  # positive seconds, else ConfigError


class Heartbeat:
    """Beats for this rank and watches the others (a no-op without a process group of 2+ ranks)."""

    def __init__(self, interval: float = 1.0, timeout: float | None = None):
        self.active = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        self.interval = interval
        self.timeout = heartbeat_timeout() if timeout is None else timeout
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.where = "setup"
        """What the main thread is doing (named in the message)."""
        if not self.active:
            return
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.store = default_store()
        self._beat()
        self._thread = threading.Thread(target=self._run, name="nnscaler-heartbeat", daemon=True)
        self._thread.start()

    def _key(self, rank: int, what: str = "heartbeat") -> str:
        return f"{PREFIX}/{what}/{rank}"

    def _beat(self) -> None:
        self.store.add(self._key(self.rank), 1)

    def _counts(self) -> dict[int, int]:
        return {r: self.store.add(self._key(r), 0) for r in range(self.world) if r != self.rank}

    def _run(self) -> None:
        last = {}
        seen = {}
        while not self._stop.wait(self.interval):
            try:
                self._beat()
                now = time.monotonic()
                for r, count in self._counts().items():
                    if last.get(r) != count:
                        last[r], seen[r] = count, now
                silent = [r for r, t in seen.items() if now - t > self.timeout]
            except Exception as exc:  # the store is gone: its host (rank 0 or the launcher) died
                if self._stop.is_set():
                    return
                self._die(
                    f"rank {self.rank}: lost contact with the process-group store during {self.where} ({exc}); "
                    "rank 0 (or the launcher hosting the store) probably died"
                )
                return
            if silent:
                self._die(self._message(silent, f"sent no heartbeat for {self.timeout:g} s"))
                return

    def _die(self, message: str) -> None:
        print(f"nnscaler: PeerError: {message}", file=sys.stderr, flush=True)
        os._exit(1)

    def _message(self, ranks: list[int], how: str) -> str:
        parts = []
        for r in ranks:
            failure = self._failure(r)
            parts.append(f"rank {r} failed: {failure}" if failure else f"rank {r} died ({how})")
        return (
            f"rank {self.rank}: {'; '.join(parts)}, during {self.where}. Restart the job (resume with "
            "checkpoint.resume_from=last); see the dead rank's log for the cause"
        )

    def _failure(self, rank: int) -> str | None:
        key = self._key(rank, "failed")
        try:
            if not self.store.check([key]):
                return None
            out = Outcome.from_bytes(self.store.get(key))
        except Exception:
            return None
        return f"{out.error_type}: {out.message}"

    def publish_failure(self, error: BaseException) -> None:
        """Tell the peers why this rank stops (they name it in their errors)."""
        if self.active:
            try:
                self.store.set(self._key(self.rank, "failed"), Outcome.of(error).to_bytes())
            except Exception:
                pass

    def diagnose(self, error: BaseException, watch: float | None = None) -> PeerError | None:
        """After `error` in a collective: the PeerError naming the peers that died or failed, or None
        when every peer is alive and well (the error is then this rank's own)."""
        if not self.active:
            return None
        watch = 4 * self.interval if watch is None else watch
        try:
            before = self._counts()
            time.sleep(watch)
            after = self._counts()
        except Exception:
            return PeerError(
                f"rank {self.rank}: the process-group store is gone during {self.where}; rank 0 probably died"
            )
        dead = sorted(r for r in before if after[r] == before[r])
        if not dead:
            return None
        return PeerError(
            self._message(dead, f"no heartbeat for {watch:g} s") + f" (here: {type(error).__name__}: {error})"
        )

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5 * self.interval)
