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

`fn` and its arguments must be picklable (a module-level function: the child imports its module).

Children are forked from a fork server (`mp_context()`, multiprocessing's "forkserver" start method)
that has imported torch, transformers' zoo models and the compiler's other libraries once: a
"spawn"ed child spent 3 to 10 s of CPU importing them, and the suite starts over a thousand children
on 2 cores. The child is otherwise as fresh as a spawned one: nothing of nnscaler or of the tests is
imported before it starts, it takes the parent's environment as it is at `spawn` time (`os.environ`
is replaced by the parent's), and its stdout / stderr are written to files in the run's directory and
copied to the parent's file descriptors 1 / 2 when the run ends (a fork server's children would
otherwise write to whatever the server inherited: pytest's capture of the test that started it).
"""

from __future__ import annotations

import faulthandler
import gc
import math
import os
import pickle
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nnscaler.runtime.device import uninit

__all__ = ["spawn", "SpawnError", "DEFAULT_TIMEOUT", "mp_context", "child_setup", "replay_output"]

DEFAULT_TIMEOUT = 240.0
"""Seconds a whole spawn may take; below the per-test pytest timeout so that ours fires first."""

FAILURE_GRACE = 10.0
"""Seconds the other ranks get to finish (or fail themselves) after one rank has failed."""


class SpawnError(RuntimeError):
    """One or more ranks failed, crashed or timed out; the message holds every rank's story."""


FORKSERVER_PRELOAD = [
    "torch",
    "torch.distributed",
    "torch.multiprocessing",
    "torch.nn.functional",
    "numpy",
    "sympy",
    "networkx",
    "jinja2",
    "pulp",
    "filelock",
    "safetensors.torch",
    "yaml",
    "psutil",
    "tqdm",
    # the zoo's transformers models (tests/zoo.py imports them lazily): ~7 s of CPU per child otherwise
    "transformers",
    "transformers.models.llama.modeling_llama",
    "transformers.models.gpt2.modeling_gpt2",
    "transformers.models.mistral.modeling_mistral",
    "transformers.models.mixtral.modeling_mixtral",
    "transformers.models.bert.modeling_bert",
    "transformers.models.vit.modeling_vit",
    # the families of tests/zoo_families.py and the fine-tunes
    "transformers.models.t5.modeling_t5",
    "transformers.models.bart.modeling_bart",
    "transformers.models.whisper.modeling_whisper",
    "transformers.models.deepseek_v3.modeling_deepseek_v3",
    "transformers.models.qwen2_moe.modeling_qwen2_moe",
    "transformers.models.mamba.modeling_mamba",
    "transformers.models.modernbert.modeling_modernbert",
    "diffusers",
    "peft",
]
"""Third-party modules the fork server imports once for all children. Neither nnscaler nor the tests
are in it: those are imported by each child, in the parent's environment (NNSCALER_LOG, for one, is
read when nnscaler is imported). A module missing here is skipped by the server, not an error."""


def mp_context() -> Any:
    """The multiprocessing context every multi-process test starts its ranks with (see the module doc)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # takes effect when this process starts its server
    return ctx


def child_setup(workdir: str | os.PathLike, rank: int, env: dict[str, str]) -> None:
    """First thing in a child: the parent's environment, and stdout / stderr into files in `workdir`
    (copied back by `replay_output`)."""
    os.environ.clear()
    os.environ.update(env)
    for fd, name, stream in ((1, "stdout", sys.stdout), (2, "stderr", sys.stderr)):
        stream.flush()
        out = os.open(Path(workdir, f"{name}_rank{rank}.txt"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, fd)
        os.close(out)


def replay_output(workdir: str | os.PathLike, world_size: int) -> None:
    """Copy the children's stdout / stderr files (see `child_setup`) to this process's fds 1 / 2,
    where a spawned child would have written them (pytest's capture of the running test)."""
    for fd, name, stream in ((1, "stdout", sys.stdout), (2, "stderr", sys.stderr)):
        stream.flush()
        for rank in range(world_size):
            path = Path(workdir, f"{name}_rank{rank}.txt")
            if path.exists():
                data = path.read_bytes()
                while data:
                    data = data[os.write(fd, data) :]


def _result_path(workdir: Path, rank: int) -> Path:
    return workdir / f"result_rank{rank}.pkl"


def _error_path(workdir: Path, rank: int) -> Path:
    return workdir / f"error_rank{rank}.txt"


def _stack_path(workdir: Path, rank: int) -> Path:
    return workdir / f"stack_rank{rank}.txt"


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _child(
    rank: int,
    world_size: int,
    workdir: str,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    env: dict[str, str],
) -> None:
    wd = Path(workdir)
    child_setup(wd, rank, env)
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
    )
    # Several ranks share 2 cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    # On a timeout the parent sends SIGUSR1 first: every thread's Python stack lands in this file.
    stack_file = open(_stack_path(wd, rank), "w")  # noqa: SIM115 (kept open for the process's life)
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    try:
        store = dist.FileStore(str(wd / "filestore"), world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        data = pickle.dumps(fn(rank, world_size, *args))
    except BaseException:
        # Written before the process group goes away with this process: the peers fail only after
        # that, so the file times put the cause first.
        _write_atomically(_error_path(wd, rank), traceback.format_exc().encode())
        raise SystemExit(1) from None
    dist.barrier()  # no rank tears the group down while a peer still has collectives in flight
    # Modules, reducers and nnscaler's group cache hold process groups, often in reference cycles: a
    # gloo group destroyed only during interpreter teardown can abort the process ("terminate called
    # without an active exception"), so every group goes now, while Python is fully alive.
    gc.collect()
    uninit()
    _write_atomically(_result_path(wd, rank), data)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # and skip the interpreter teardown: the result is on disk


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
    ctx = mp_context()
    env = dict(os.environ)
    procs = [
        ctx.Process(target=_child, args=(rank, world_size, str(workdir), fn, args, env), name=f"rank{rank}")
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
        if timed_out:
            _dump_stacks(procs)
        stopped = _stop(procs)
        replay_output(workdir, world_size)

    # (when, headline, story); sorted by time, since the first failure is usually the cause
    problems: list[tuple[float, str, str]] = []
    for rank, p in enumerate(procs):
        err = _error_path(workdir, rank)
        if err.exists():
            text = err.read_text()
            last = text.strip().splitlines()[-1] if text.strip() else "?"
            problems.append(
                (err.stat().st_mtime, f"rank {rank} raised {last}", f"--- rank {rank} raised:\n{text}")
            )
        elif rank in stopped:
            why = (
                f"did not finish within {timeout:.0f} s"
                if timed_out
                else "was stopped after another rank failed"
            )
            headline = f"rank {rank} {why} (still running; likely waiting in a collective)"
            story = f"--- {headline}"
            stack = _stack_path(workdir, rank)
            if timed_out and stack.exists() and stack.read_text().strip():
                story += f"; its Python stacks:\n{stack.read_text()}"
            problems.append((math.inf, headline, story))
        elif p.exitcode != 0:
            headline = f"rank {rank} died with exit code {p.exitcode} and no traceback (see captured stderr)"
            problems.append((math.inf, headline, f"--- {headline}"))
        elif not _result_path(workdir, rank).exists():
            headline = f"rank {rank} exited without writing a result"
            problems.append((math.inf, headline, f"--- {headline}"))
    if problems:
        problems.sort(key=lambda item: item[0])
        raise SpawnError(
            f"{len(problems)} of {world_size} ranks failed; first: {problems[0][1]}\n"
            + "\n".join(story for _, _, story in problems)
        )
    return [pickle.loads(_result_path(workdir, rank).read_bytes()) for rank in range(world_size)]


def _dump_stacks(procs: list[Any]) -> None:
    """Ask every running child to write its Python stacks (see _child), and give it a moment."""
    for p in procs:
        if p.is_alive() and p.pid is not None:
            try:
                os.kill(p.pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
    time.sleep(1.0)


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
