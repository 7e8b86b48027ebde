"""Process-group start-up under torchrun and the device generated code allocates on."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["init", "uninit", "is_initialized", "runtime_device"]


def is_initialized() -> bool:
    """Whether torch.distributed is available and a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def init() -> None:
    """Start the default process group when running under torchrun ($RANK and $WORLD_SIZE set).

    NCCL when CUDA is available (the CUDA device is set to $LOCAL_RANK first), gloo otherwise.
    Idempotent: does nothing when a process group already exists or when not under torchrun.
    """
    if is_initialized() or not dist.is_available():
        return
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend="nccl")
    else:
        dist.init_process_group(backend="gloo")


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
