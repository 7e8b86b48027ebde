"""Run a function on N real processes joined in a gloo process group, and collect what each returns.

    results = spawn(fn, 2, tmp_path, arg1, arg2, timeout=120)   # [fn's result on rank 0, on rank 1]

Each child sets RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE (as torchrun would), joins the
default process group through a FileStore in `tmp_path` (no TCP port, so parallel test runs cannot
collide), calls `fn(rank, world_size, *args)`, and saves the result to a file that the parent
loads. A child that raises has its traceback saved instead; the parent raises `SpawnError` with
every child's traceback in the message. A child that dies without a word (a crash, a kill) is
reported with its exit code. When one child fails, the others, likely blocked in a collective
waiting for it, are given a short grace period and then terminated; when the whole run exceeds
`timeout` seconds, every child still running is terminated and the error names the ranks that did
not finish. So a bug fails the test instead of hanging it.

`fn` and its arguments must be picklable (a module-level function; the "spawn" start method
re-imports its module in the child).
"""

from __future__ import annotations

import os
import pickle
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["spawn", "SpawnError", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = 240.0
"""Seconds a whole spawn may take; below the per-test pytest timeout so that ours fires first."""

FAILURE_GRACE = 10.0
"""Seconds the other ranks get to finish (or fail themselves) after one rank has failed."""


class SpawnError(RuntimeError):
    """One or more ranks failed, crashed or timed out; the message holds every rank's story."""


def _result_path(workdir: Path, rank: int) -> Path:
    return workdir / f"result_rank{rank}.pkl"


def _error_path(workdir: Path, rank: int) -> Path:
    return workdir / f"error_rank{rank}.txt"


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _child(
    rank: int, world_size: int, workdir: str, fn: Callable[..., Any], args: tuple[Any, ...]
) -> None:
    wd = Path(workdir)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
    )
    # Several ranks share 2 cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    try:
        store = dist.FileStore(str(wd / "filestore"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        try:
            result = fn(rank, world_size, *args)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
        _write_atomically(_result_path(wd, rank), pickle.dumps(result))
    except BaseException:
        _write_atomically(_error_path(wd, rank), traceback.format_exc().encode())
        raise SystemExit(1) from None


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    tmp_path: str | os.PathLike,
    *args: Any,
    timeout: float = DEFAULT_TIMEOUT,
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` processes; return the results by rank.

    Raises `SpawnError` if any rank raises, exits abnormally, or the run exceeds `timeout` seconds.
    """
    workdir = Path(tmp_path) / f"spawn_{time.monotonic_ns()}"
    workdir.mkdir(parents=True)
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(target=_child, args=(rank, world_size, str(workdir), fn, args), name=f"rank{rank}")
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()

    deadline = time.monotonic() + timeout
    first_failure: float | None = None
    timed_out = False
    try:
        while any(p.is_alive() for p in procs):
            now = time.monotonic()
            if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
                first_failure = now
            if now > deadline or (first_failure is not None and now - first_failure > FAILURE_GRACE):
                timed_out = now > deadline
                break
            time.sleep(0.05)
    finally:
        stopped = _stop(procs)

    problems: list[str] = []
    for rank, p in enumerate(procs):
        err = _error_path(workdir, rank)
        if err.exists():
            problems.append(f"--- rank {rank} raised:\n{err.read_text()}")
        elif rank in stopped:
            why = f"did not finish within {timeout:.0f} s" if timed_out else "was stopped after another rank failed"
            problems.append(f"--- rank {rank} {why} (still running; likely waiting in a collective)")
        elif p.exitcode != 0:
            problems.append(f"--- rank {rank} died with exit code {p.exitcode} and no traceback")
        elif not _result_path(workdir, rank).exists():
            problems.append(f"--- rank {rank} exited without writing a result")
    if problems:
        raise SpawnError(f"{len(problems)} of {world_size} ranks failed:\n" + "\n".join(problems))
    return [pickle.loads(_result_path(workdir, rank).read_bytes()) for rank in range(world_size)]


def _stop(procs: list[Any]) -> set[int]:
    """Terminate (then kill) every child still running; return the ranks that had to be stopped."""
    stopped = {rank for rank, p in enumerate(procs) if p.is_alive()}
    for rank in stopped:
        procs[rank].terminate()
    for rank in stopped:
        procs[rank].join(5)
        if procs[rank].is_alive():
            procs[rank].kill()
            procs[rank].join(5)
    for p in procs:
        p.join(1)
    return stopped
