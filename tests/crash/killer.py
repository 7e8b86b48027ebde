"""Kill a writer with SIGKILL at a chosen file-system operation, or after a chosen number of bytes.

`count_points(fn)` runs `fn` in a forked child with counting wrappers installed around the
operations a writer commits state with (open for writing, write, fsync, rename/replace, mkdir,
unlink/remove/rmdir, symlink, sendfile) and returns what it saw (`Trace`). `run_killed(fn, point)`
forks again with the same wrappers, and the child sends itself SIGKILL just before operation
number `point.op` (of those other than write) or once `point.nbytes` bytes are written (the write that crosses the limit
writes only its first bytes, as a crash inside write(2) may leave). `spread_points(trace, n)`
picks `n` points spread over the whole write: half by operation, half by byte count.

The children are forked (multiprocessing's 'fork' context) from a parent that has imported torch
and built its state, so each kill point costs a fork, not a Python start-up. The child never runs
parent cleanups: it ends with SIGKILL, or with os._exit after `fn` returns.

safetensors writes from Rust, where no Python wrapper sees the bytes: in the child its `save_file`
is replaced by `safetensors.torch.save` (same bytes) plus a counted write, so kills land inside
safetensors files too.
"""

from __future__ import annotations

import builtins
import io
import multiprocessing
import os
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Point", "Trace", "Outcome", "count_points", "run_killed", "spread_points"]

_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_OS_OPS = ("replace", "rename", "fsync", "mkdir", "unlink", "remove", "rmdir", "symlink", "sendfile")
_CHUNK = 1 << 16  # a large write counts once per 64 KiB, so byte points fall inside big files


@dataclass(frozen=True)
class Point:
    """Where to kill: before operation number `op` (1-based, counting the operations other than
    `write`, so that a writer issuing its bytes in more or fewer calls keeps its points), or after
    `nbytes` bytes (or both: whichever comes first)."""

    op: int | None = None
    nbytes: int | None = None

    def __str__(self) -> str:
        return f"op {self.op}" if self.op is not None else f"byte {self.nbytes}"


@dataclass
class Trace:
    """What a dry run saw: one `kind: detail` line per operation, and the bytes written."""

    ops: list[str] = field(default_factory=list)
    nbytes: int = 0

    @property
    def meta_ops(self) -> list[str]:
        """The operations other than `write` (what `Point.op` counts)."""
        return [op for op in self.ops if not op.startswith("write:")]


@dataclass(frozen=True)
class Outcome:
    """How a killed run ended: `killed` (SIGKILL at the point) or finished (the point lay beyond)."""

    killed: bool


class _Counter:
    """The child's count of operations and bytes; kills the process at the point."""

    def __init__(self, point: Point | None) -> None:
        self.point = point
        self.trace = Trace()

    def op(self, kind: str, detail: Any) -> None:
        if kind != "write":
            n = len(self.trace.meta_ops) + 1
            if self.point is not None and self.point.op is not None and n >= self.point.op:
                _die()
        self.trace.ops.append(f"{kind}: {detail}")

    def allowed(self, size: int) -> int:
        """How many of `size` bytes may be written before the byte limit."""
        if self.point is None or self.point.nbytes is None:
            return size
        return max(0, min(size, self.point.nbytes - self.trace.nbytes))


def _die() -> None:
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class _CountingFile:
    """A file opened for writing whose writes are counted (everything else goes to the real file)."""

    def __init__(self, f: Any, counter: _Counter, name: Any) -> None:
        self._f, self._c, self._name = f, counter, name

    def write(self, data: Any) -> int:
        view = memoryview(data if not isinstance(data, str) else data.encode("utf-8"))
        raw = view.cast("B") if view.ndim != 1 or view.format != "B" else view
        for start in range(0, max(len(raw), 1), _CHUNK):
            chunk = raw[start : start + _CHUNK]
            self._c.op("write", f"{self._name} +{len(chunk)}")
            allowed = self._c.allowed(len(chunk))
            if allowed < len(chunk):
                self._write(chunk[:allowed], data)
                self._f.flush()
                _die()
            self._write(chunk, data)
            self._c.trace.nbytes += len(chunk)
        return len(data)

    def _write(self, chunk: memoryview, data: Any) -> None:
        self._f.write(chunk.tobytes().decode("utf-8") if isinstance(data, str) else chunk)

    def writelines(self, lines: Any) -> None:
        for line in lines:
            self.write(line)

    def __enter__(self) -> _CountingFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()

    def __iter__(self) -> Any:
        return iter(self._f)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


def _is_write_mode(mode: str) -> bool:
    return any(c in mode for c in "wax+")


def _install(counter: _Counter) -> None:
    """Wrap the operations in this (child) process."""
    real_open = io.open

    def counting_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if not _is_write_mode(mode):
            return real_open(file, mode, *args, **kwargs)
        counter.op("open", file)
        return _CountingFile(real_open(file, mode, *args, **kwargs), counter, file)

    builtins.open = io.open = counting_open  # type: ignore[assignment]
    real_os_open = os.open

    def os_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & _WRITE_FLAGS:
            counter.op("open", path)
        return real_os_open(path, flags, *args, **kwargs)

    os.open = os_open  # type: ignore[assignment]
    real_os_write = os.write

    def os_write(fd: int, data: Any) -> int:
        counter.op("write", f"fd {fd} +{len(data)}")
        allowed = counter.allowed(len(data))
        if allowed < len(data):
            real_os_write(fd, bytes(data)[:allowed])
            _die()
        counter.trace.nbytes += len(data)
        return real_os_write(fd, data)

    os.write = os_write  # type: ignore[assignment]
    for name in _OS_OPS:
        _wrap_os(name, counter)
    _wrap_safetensors(counter)


def _wrap_os(name: str, counter: _Counter) -> None:
    real = getattr(os, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        counter.op(name, " -> ".join(str(a) for a in args[:2]))
        return real(*args, **kwargs)

    setattr(os, name, wrapped)


def _wrap_safetensors(counter: _Counter) -> None:
    try:
        import safetensors.torch as st
    except ImportError:
        return
    real = st.save_file

    def save_file(tensors: Any, filename: Any, metadata: Any = None) -> None:
        data = st.save(tensors, metadata=metadata)
        with open(filename, "wb") as f:  # the counting open installed above
            f.write(data)

    for module in list(sys.modules.values()):  # modules that imported the name (`from ... import`)
        if getattr(module, "save_file", None) is real:
            module.save_file = save_file


def _child(fn: Callable[[], Any], point: Point | None, conn: Any) -> None:
    counter = _Counter(point)
    try:
        _install(counter)
        fn()
    except BaseException:  # noqa: BLE001 - reported to the parent
        conn.send(("error", traceback.format_exc()))
    else:
        conn.send(("done", counter.trace))
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _run(fn: Callable[[], Any], point: Point | None, timeout: float) -> tuple[int, Any]:
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(fn, point, send))
    proc.start()
    send.close()
    msg = None
    try:
        if recv.poll(timeout):
            msg = recv.recv()
    except EOFError:  # killed: the pipe closed without a message
        pass
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise TimeoutError(f"the writer did not finish within {timeout} s")
    recv.close()
    return proc.exitcode, msg


def count_points(fn: Callable[[], Any], timeout: float = 120.0) -> Trace:
    """Run `fn` to the end in a forked child, counting its operations and bytes."""
    code, msg = _run(fn, None, timeout)
    if msg is None or msg[0] != "done":
        detail = msg[1] if msg else f"exit code {code}"
        raise RuntimeError(f"the dry run of the writer failed:\n{detail}")
    return msg[1]


def run_killed(fn: Callable[[], Any], point: Point, timeout: float = 120.0) -> Outcome:
    """Run `fn` in a forked child that SIGKILLs itself at `point`."""
    code, msg = _run(fn, point, timeout)
    if code == -signal.SIGKILL:
        return Outcome(killed=True)
    if msg is not None and msg[0] == "error":
        raise RuntimeError(f"the writer failed (not killed) at {point}:\n{msg[1]}")
    return Outcome(killed=False)


def _spread(values: list[int], n: int) -> list[int]:
    """`n` of `values` evenly spaced, first and last included (all of them when n >= len)."""
    if n >= len(values):
        return list(values)
    if n == 1:
        return [values[-1]]
    return [values[round(i * (len(values) - 1) / (n - 1))] for i in range(n)]


def spread_points(trace: Trace, n: int) -> list[Point]:
    """`n` points spread over the whole write: before operations other than `write` (the opens,
    fsyncs, renames, mkdirs and unlinks that decide what a crash leaves), first and last included,
    and after byte counts spread over the first 99% of the bytes written (which also kills inside
    writes)."""
    meta = list(range(1, len(trace.meta_ops) + 1))
    by_ops = min(len(meta), max(n - n // 2, n - (trace.nbytes - 1)))
    points = [Point(op=k) for k in _spread(meta, by_ops)]
    by_bytes = n - len(points)
    # the last 1% is left out: a writer's byte count can vary a little from run to run (pickle
    # memoisation follows object identity), and a point past the end would not kill
    end = max(1, trace.nbytes - 1 - trace.nbytes // 100)
    if by_bytes and trace.nbytes > 1:
        points += [Point(nbytes=1 + (i * (end - 1)) // max(by_bytes - 1, 1)) for i in range(by_bytes)]
    return points
