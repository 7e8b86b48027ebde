"""Process-group start-up under torchrun and the device generated code allocates on."""

from __future__ import annotations

import datetime
import os
import warnings

import torch
import torch.distributed as dist

from nnscaler.runtime.timeouts import collective_timeout

__all__ = ["init", "uninit", "is_initialized", "runtime_device"]


def is_initialized() -> bool:
    """Whether torch.distributed is available and a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def init(timeout: datetime.timedelta | float | None = None) -> None:
    """Start the default process group when running under torchrun ($RANK and $WORLD_SIZE set).

    NCCL when CUDA is available (the CUDA device is set to $LOCAL_RANK first), gloo otherwise.
    `timeout` (a timedelta or seconds; default $NNSCALER_TIMEOUT seconds, else 10 minutes) bounds
    every collective: one that a peer does not join raises after it instead of after gloo's 30
    minutes. Rank 0's compile in `parallelize` is not bound by it (see NNSCALER_COMPILE_TIMEOUT).
    Idempotent: does nothing when a process group already exists or when not under torchrun.
    """
    wait = collective_timeout(timeout)  # validated even when there is nothing to start
    if is_initialized() and timeout is not None:
        warnings.warn(
            f"nnscaler.init(timeout={timeout!r}) has no effect: a process group already exists "
            "(pass the timeout to the torch.distributed.init_process_group that created it)",
            stacklevel=2,
        )
    if is_initialized() or not dist.is_available():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl", timeout=wait)
    else:
        dist.init_process_group(backend="gloo", timeout=wait)


def uninit() -> None:
    """Destroy the default process group (and forget cached groups); no-op when none exists."""
    from nnscaler.runtime.groups import clear_groups

    clear_groups()
    if is_initialized():
        dist.destroy_process_group()


def runtime_device() -> torch.device:
    """`cuda:LOCAL_RANK` when the process group runs NCCL, else `cpu`."""
    if is_initialized() and "nccl" in str(dist.get_backend()).lower():
        if "LOCAL_RANK" in os.environ:
            return torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
