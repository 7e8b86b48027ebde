"""Communication timeline (Horovod's idea): every collective and point-to-point op a rank issues, with
its bytes, group and duration, written as Chrome trace JSON that Perfetto (ui.perfetto.dev) or
chrome://tracing open.

Turn it on for a whole run with `NNSCALER_TIMELINE=/path/trace.json` (read by `nnscaler.init()`;
written when the process group is torn down by `uninit()` and at exit), or for a region with
`with timeline("trace.json"): ...`. Each rank writes its own file (`trace.rank{r}.json`, or the path
with `{rank}` replaced); `merge_timelines` (and `python -m nnscaler.runtime.dist.timeline OUT IN...`)
joins them into one trace with a process per rank and a track per communicator.

How: torch.distributed has no per-call hook for collectives (torch.profiler records them, but with
every other op too, at a cost that distorts a communication timeline), so while the timeline is on,
the torch.distributed functions are wrapped and restored afterwards. An op's duration runs from
its issue to its completion: the completion callback of its future (async collectives), the return
of the call (blocking ones), or the return of `wait()` on the work (ops whose work has no future,
such as gloo's P2P: the work handed back is then a thin proxy). On CUDA with
`TORCH_NCCL_ENABLE_TIMING=1` the device-side duration NCCL measured is used where it is available.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from nnscaler import env_vars

__all__ = ["timeline", "start", "stop", "flush", "start_from_env", "span", "merge_timelines", "ENV"]

ENV = "NNSCALER_TIMELINE"
"""Environment variable: a path turns the timeline on for the whole run (see the module docstring)."""

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "reduce",
    "barrier",
    "all_gather_object",
    "broadcast_object_list",
)
P2P = ("send", "recv", "isend", "irecv")


@dataclass
class _Event:
    name: str
    cat: str
    track: str
    ts_us: float
    start_ns: int
    args: dict[str, Any]
    dur_us: float | None = None


@dataclass
class _Recorder:
    path: str
    events: list[_Event] = field(default_factory=list)
    originals: dict[str, Callable[..., Any]] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    written: bool = False


_recorder: _Recorder | None = None


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _group_label(group: Any) -> tuple[str, list[int]]:
    try:
        ranks = (
            dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
        )
    except Exception:  # a group this rank is not in, or no default group yet
        ranks = []
    return ("world" if group is None else "group " + ",".join(map(str, ranks))), ranks


def _describe(name: str, args: tuple, kwargs: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """(category, track, args) of one call of torch.distributed.`name`."""
    tensors = _tensors(list(args) + [v for k, v in kwargs.items() if k != "group"])
    info: dict[str, Any] = {"bytes": sum(t.numel() * t.element_size() for t in tensors)}
    if tensors:
        info["dtype"] = str(tensors[0].dtype).removeprefix("torch.")
        info["shape"] = list(tensors[0].shape)
    if name in P2P:
        peer = kwargs.get("dst", kwargs.get("src", args[1] if len(args) > 1 else None))
        info["peer"] = peer
        return "p2p", f"p2p with rank {peer}", info
    label, ranks = _group_label(kwargs.get("group"))
    info["group"] = ranks
    return "collective", label, info


class _TimedWork:
    """A work without a future (gloo P2P): its op ends when `wait()` returns (or when first seen done)."""

    def __init__(self, work: Any, event: _Event) -> None:
        self._work, self._event = work, event

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self._work.wait(*args, **kwargs)
        _finish(self._event)
        return out

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done:
            _finish(self._event)
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


def _finish(event: _Event, work: Any = None) -> None:
    if event.dur_us is not None:
        return
    measured = None
    if work is not None and env_vars.read("TORCH_NCCL_ENABLE_TIMING"):
        try:
            measured = float(work._get_duration()) * 1000.0  # ms on the device (NCCL)
        except Exception:  # not measured by this backend
            measured = None
    event.dur_us = measured if measured is not None else (time.perf_counter_ns() - event.start_ns) / 1000.0


def _record(rec: _Recorder, name: str, args: tuple, kwargs: dict[str, Any]) -> _Event:
    cat, track, info = _describe(name, args, kwargs)
    event = _Event(name, cat, track, time.time_ns() / 1000.0, time.perf_counter_ns(), info)
    with rec.lock:
        rec.events.append(event)
    return event


def _watch(event: _Event, result: Any) -> Any:
    """Stamp the end of `event` when `result` (None, a work, or a list of works) completes."""
    if result is None:
        _finish(event)
        return result
    if isinstance(result, list):
        return [_watch(event, w) if i == len(result) - 1 else w for i, w in enumerate(result)]
    try:
        result.get_future().add_done_callback(lambda _fut, w=result: _finish(event, w))
        return result
    except Exception:  # no future (gloo P2P): time it to wait()
        return _TimedWork(result, event)


def _wrap(rec: _Recorder, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def traced(*args: Any, **kwargs: Any) -> Any:
        if name == "batch_isend_irecv":
            ops = args[0] if args else kwargs["p2p_op_list"]
            event = _record(rec, name, (), {})
            event.cat, event.track = "p2p", "p2p batch"
            event.args = {
                "bytes": sum(op.tensor.numel() * op.tensor.element_size() for op in ops),
                "ops": [f"{op.op.__name__} {op.peer}" for op in ops],
            }
        else:
            event = _record(rec, name, args, kwargs)
        return _watch(event, original(*args, **kwargs))

    return traced


def start(path: str) -> None:
    """Start recording into `path` (see the module docstring); no-op when already recording."""
    global _recorder
    if _recorder is not None:
        return
    rec = _Recorder(path)
    for name in (*COLLECTIVES, *P2P, "batch_isend_irecv"):
        original = getattr(dist, name, None)
        if original is not None:
            rec.originals[name] = original
            setattr(dist, name, _wrap(rec, name, original))
    _recorder = rec


def stop() -> str | None:
    """Stop recording, restore torch.distributed and write this rank's file; returns its path."""
    global _recorder
    rec, _recorder = _recorder, None
    if rec is None:
        return None
    for name, original in rec.originals.items():
        setattr(dist, name, original)
    return _write(rec)


def flush() -> str | None:
    """Write what was recorded so far (recording goes on); returns the file's path."""
    return _write(_recorder) if _recorder is not None else None


def start_from_env() -> None:
    """`nnscaler.init()`: start the timeline when $NNSCALER_TIMELINE names a path (written at exit too)."""
    path = env_vars.read(ENV)
    if path and _recorder is None:
        os.environ.setdefault("TORCH_NCCL_ENABLE_TIMING", "1")  # device-side durations on NCCL
        start(path)
        atexit.register(stop)


@contextmanager
def timeline(path: str) -> Iterator[None]:
    """Record the communication issued inside the block into `path` (one file per rank)."""
    start(path)
    try:
        yield
    finally:
        stop()


@contextmanager
def span(name: str, **args: Any) -> Iterator[None]:
    """A compute region (e.g. `train_step`) on the rank's own track while the timeline is on."""
    rec = _recorder
    if rec is None:
        yield
        return
    event = _Event(name, "step", "steps", time.time_ns() / 1000.0, time.perf_counter_ns(), dict(args))
    try:
        yield
    finally:
        _finish(event)
        with rec.lock:
            rec.events.append(event)


def _rank() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return env_vars.read("RANK") or 0


def rank_path(path: str, rank: int) -> str:
    """This rank's file: `path` with `{rank}` replaced, else `stem.rank{rank}.json`."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext or '.json'}"


def _write(rec: _Recorder) -> str:
    rank = _rank()
    with rec.lock:
        events = list(rec.events)
    tracks: dict[str, int] = {}
    trace: list[dict[str, Any]] = [
        {"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}
    ]
    for e in events:
        if e.track not in tracks:
            tracks[e.track] = len(tracks)
            trace.append(
                {
                    "name": "thread_name",
                    "ph": "M",
                    "pid": rank,
                    "tid": tracks[e.track],
                    "args": {"name": e.track},
                }
            )
        item = {"name": e.name, "cat": e.cat, "ph": "X", "ts": e.ts_us, "pid": rank, "tid": tracks[e.track]}
        item["dur"] = e.dur_us if e.dur_us is not None else 0.0
        item["args"] = {**e.args, **({} if e.dur_us is not None else {"unfinished": True})}
        trace.append(item)
    out = rank_path(rec.path, rank)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = f"{out}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, out)  # a reader never sees half a file
    rec.written = True
    return out


def merge_timelines(paths: Sequence[str], out: str | None = None) -> dict[str, Any]:
    """Join per-rank timeline files into one trace (each keeps its `pid` = rank); write it to `out`."""
    events: list[dict[str, Any]] = []
    for path in paths:
        with open(path) as f:
            events.extend(json.load(f)["traceEvents"])
    merged = {"traceEvents": events, "displayTimeUnit": "ms"}
    if out is not None:
        with open(out, "w") as f:
            json.dump(merged, f)
    return merged


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2:
        print(
            "usage: python -m nnscaler.runtime.dist.timeline OUT.json RANK0.json [RANK1.json ...]", file=sys.stderr
        )
        return 2
    merged = merge_timelines(args[1:], args[0])
    print(f"{args[0]}: {len(merged['traceEvents'])} events from {len(args) - 1} files")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
