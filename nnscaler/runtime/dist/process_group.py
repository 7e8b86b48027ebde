"""Whether this process has a default process group, and whether it runs NCCL (a leaf every part of
the runtime may ask, below device start-up and groups)."""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["is_initialized", "uses_nccl"]


def is_initialized() -> bool:
    """Whether torch.distributed is available and a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def uses_nccl() -> bool:
    """Whether the default process group exists and its backend is NCCL."""
    return is_initialized() and "nccl" in str(dist.get_backend()).lower()
