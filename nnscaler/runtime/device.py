"""Process-group start-up under torchrun and the device generated code allocates on."""

from __future__ import annotations

import datetime
import warnings

import torch
import torch.distributed as dist

from nnscaler import env_vars
from nnscaler.runtime.dist import lifecycle, timeline
from nnscaler.runtime.dist.groups import clear_groups
from nnscaler.runtime.dist.process_group import is_initialized, uses_nccl
from nnscaler.runtime.dist.timeouts import collective_timeout

__all__ = ["init", "uninit", "is_initialized", "runtime_device", "local_cuda_index", "bind_cuda_device"]


BACKEND_ENV = "NNSCALER_BACKEND"
"""Environment variable: the process-group backend `init` starts ('nccl' or 'gloo')."""


def init(timeout: datetime.timedelta | float | None = None, backend: str | None = None) -> None:
    """Start the default process group when running under torchrun ($RANK and $WORLD_SIZE set).

    `backend` ('nccl' or 'gloo'; default $NNSCALER_BACKEND, else NCCL when CUDA is available and gloo
    otherwise): 'gloo' on a GPU machine runs everything on the CPU, e.g. a 4-process CPU demo on a
    machine with fewer GPUs than processes. Under NCCL the process's CUDA device (see
    `local_cuda_index`) is made current and given to the process group as `device_id`, so NCCL binds
    its communicators to it at once and object collectives run on it.
    `timeout` (a timedelta or seconds; default $NNSCALER_TIMEOUT seconds, else 10 minutes) bounds
    every collective: one that a peer does not join raises after it instead of after gloo's 30
    minutes. Rank 0's compile in `parallelize` is not bound by it (see NNSCALER_COMPILE_TIMEOUT).
    Idempotent: does nothing when a process group already exists or when not under torchrun.
    """
    wait = collective_timeout(timeout)  # validated even when there is nothing to start
    backend = (
        backend or env_vars.read(BACKEND_ENV) or ("nccl" if torch.cuda.is_available() else "gloo")
    ).lower()
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"nnscaler.init(backend={backend!r}) (or ${BACKEND_ENV}): use 'nccl' or 'gloo'")
    if backend == "nccl" and not torch.cuda.is_available():
        raise RuntimeError(
            f"nnscaler.init: backend 'nccl' needs CUDA, which this machine lacks: use backend='gloo' "
            f"(or unset ${BACKEND_ENV})"
        )
    timeline.start_from_env()  # $NNSCALER_TIMELINE: record every collective and P2P op
    lifecycle.register_teardown(_teardown_at_exit)
    if is_initialized() and timeout is not None:
        warnings.warn(
            f"nnscaler.init(timeout={timeout!r}) has no effect: a process group already exists "
            "(pass the timeout to the torch.distributed.init_process_group that created it)",
            stacklevel=2,
        )
    if is_initialized() or not dist.is_available():
        return
    if env_vars.read("RANK") is None or env_vars.read("WORLD_SIZE") is None:
        return
    if backend == "nccl":
        device = torch.device("cuda", local_cuda_index())
        torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl", timeout=wait, device_id=device)
    else:
        dist.init_process_group(backend="gloo", timeout=wait)


def _teardown_at_exit() -> None:
    """At interpreter exit (registered by init): what uninit does, for scripts that end without it."""
    try:
        uninit()
    except Exception:  # the process is ending: a teardown problem must not replace its exit status
        pass


def uninit() -> None:
    """Release the parallel modules' gradient buckets, destroy the default process group (and forget
    cached groups); the process group part is a no-op when none exists. Also run at exit."""
    lifecycle.release_parallel_modules()
    clear_groups()
    if is_initialized():
        timeline.flush()  # while the rank is known; the file is written again at exit
        dist.destroy_process_group()


def local_cuda_index() -> int:
    """This process's CUDA device: $LOCAL_RANK among the visible devices, or device 0 when the
    launcher gives each process one GPU of its own (CUDA_VISIBLE_DEVICES per process, e.g. SLURM)."""
    count = torch.cuda.device_count()
    local_rank = env_vars.read("LOCAL_RANK") or 0
    if count == 1:
        return 0
    if local_rank >= count:
        raise RuntimeError(
            f"LOCAL_RANK is {local_rank} but this process sees {count} CUDA devices "
            f"(CUDA_VISIBLE_DEVICES={env_vars.read('CUDA_VISIBLE_DEVICES') or '<unset>'}): start at most "
            f"{count} processes per machine, or make each process see one GPU"
        )
    return local_rank


def runtime_device() -> torch.device:
    """This process's CUDA device (`local_cuda_index`) when the process group runs NCCL, else `cpu`."""
    if uses_nccl():
        return torch.device("cuda", local_cuda_index())
    return torch.device("cpu")


def bind_cuda_device() -> None:
    """Under NCCL make `runtime_device()` the current CUDA device (a no-op otherwise).

    torch's object collectives (all_gather_object, broadcast_object_list) and NCCL's lazily made
    communicators use the current device; a process group created without `nnscaler.init` and
    without `torch.cuda.set_device` would put every rank on device 0.
    """
    if uses_nccl():
        device = runtime_device()
        if torch.cuda.current_device() != device.index:
            torch.cuda.set_device(device)
