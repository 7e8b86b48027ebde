"""Run a test function on N real gloo ranks (spawned processes, FileStore rendezvous, with a timeout).

`run_dist(fn, world_size, *args)` calls `fn(rank, world_size, *args)` in every child after the
default process group is up, and returns the children's return values by rank. A child that raises
fails the calling test with the child's traceback; a run that does not finish in time is killed.
The children come from the fork server of tests/dist_util.py (`mp_context`: torch already imported),
with the parent's environment and their stdout / stderr copied back when the run ends.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from tests.dist_util import child_setup, mp_context, replay_output

__all__ = ["run_dist"]

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load(path: str, qualname: str) -> Callable[..., Any]:
    if _HERE not in sys.path:
        sys.path.insert(0, _HERE)
    spec = importlib.util.spec_from_file_location(f"_dist_target_{abs(hash(path))}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses (and pickling) look their module up by name
    spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _child(
    rank: int, world_size: int, tmp: str, path: str, qualname: str, args: tuple, port: int, env: dict
) -> None:
    child_setup(tmp, rank, env)
    out = os.path.join(tmp, f"result{rank}.pt")
    try:
        torch.set_num_threads(1)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        if port:  # the function starts the process group itself (env:// rendezvous)
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        else:
            dist.init_process_group(
                "gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world_size
            )
        result = _load(path, qualname)(rank, world_size, *args)
        if dist.is_initialized():
            dist.barrier()  # nobody leaves while a peer may still be talking to it
        torch.save({"ok": True, "value": result}, out)
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, out)
        raise
    os._exit(0)  # skip the slow interpreter teardown; the result is on disk


def run_dist(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0, init: bool = True
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the results by rank.

    `fn` must be a module-level function (it is loaded in the children from its file). Children see
    RANK / WORLD_SIZE / LOCAL_RANK as under torchrun. With `init=False` they start without a process
    group but with MASTER_ADDR / MASTER_PORT (a free port) set, so `nnscaler.runtime.init()` can start one.
    """
    if _HERE not in sys.path:
        sys.path.insert(0, _HERE)
    import dist_util  # the children import this module by its plain name

    path = os.path.abspath(sys.modules[fn.__module__].__file__ or "")
    port = 0
    if not init:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(
            dist_util._child,
            args=(world_size, tmp, path, fn.__qualname__, args, port, dict(os.environ)),
            nprocs=world_size,
            join=False,
            start_method=mp_context().get_start_method(),
        )
        deadline = time.monotonic() + timeout
        failure = ""
        try:
            while not ctx.join(timeout=0.1):
                if time.monotonic() > deadline:
                    failure = f"did not finish in {timeout}s"
                    break
        except ProcessException as err:
            failure = f"a rank failed: {type(err).__name__}"
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
                p.join()
            replay_output(tmp, world_size)
        results, errors = [], []
        for rank in range(world_size):
            file = os.path.join(tmp, f"result{rank}.pt")
            res = torch.load(file, weights_only=False) if os.path.exists(file) else None
            if res is None:
                errors.append(f"rank {rank}: no result")
            elif not res["ok"]:
                errors.append(f"rank {rank}:\n{res['error']}")
            else:
                results.append(res["value"])
        if failure or errors:
            raise AssertionError(f"{fn.__qualname__} on {world_size} ranks {failure}\n" + "\n".join(errors))
        return results
