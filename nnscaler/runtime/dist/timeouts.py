"""How long a rank waits for its peers: collectives, rank 0's compile, and named meeting points.

Three limits, each a `datetime.timedelta`, each overridable by an environment variable in seconds:

- `collective_timeout` (NNSCALER_TIMEOUT, default 10 minutes): the process-group timeout that
  `nnscaler.init` passes to `init_process_group`; a collective that a peer never joins raises after
  it instead of gloo's 30-minute default.
- `compile_timeout` (NNSCALER_COMPILE_TIMEOUT, default 1 hour): how long the other ranks wait for
  rank 0 to trace, plan and generate code in `parallelize` (outside any collective, see store_sync).
- `arrival_timeout` (NNSCALER_ARRIVAL_TIMEOUT, default: the group's process-group timeout): how long
  the ranks that reached a meeting point (e.g. a ZeRO-3 `state_dict()`) wait for the others before
  raising and naming the ranks that did not come.
"""

from __future__ import annotations

import datetime
import math

import torch
import torch.distributed as dist

from nnscaler import env_vars

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEFAULT_COMPILE_TIMEOUT",
    "as_timedelta",
    "collective_timeout",
    "compile_timeout",
    "arrival_timeout",
    "group_timeout",
]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)
"""Collectives after compile; well below gloo's 30 minutes, equal to NCCL's 10."""

DEFAULT_COMPILE_TIMEOUT = datetime.timedelta(hours=1)
"""Rank 0's trace + plan + codegen (a large model with the autodist search can take many minutes)."""


def as_timedelta(value: datetime.timedelta | float | int, what: str) -> datetime.timedelta:
    """`value` (a timedelta or seconds) as a positive timedelta; ValueError naming `what` otherwise."""
    if isinstance(value, datetime.timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        raise ValueError(f"{what} must be a datetime.timedelta or a number of seconds, got {value!r}")
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{what} must be a positive, finite number of seconds, got {value!r}")
    return datetime.timedelta(seconds=seconds)


def _from_env(var: str, default: datetime.timedelta) -> datetime.timedelta:
    seconds = env_vars.read(var)  # ConfigError (a ValueError) naming the variable when bad
    return default if seconds is None else as_timedelta(seconds, f"environment variable {var}")


def collective_timeout(value: datetime.timedelta | float | None = None) -> datetime.timedelta:
    """`value` if given, else $NNSCALER_TIMEOUT seconds, else `DEFAULT_TIMEOUT`."""
    if value is not None:
        return as_timedelta(value, "timeout")
    return _from_env("NNSCALER_TIMEOUT", DEFAULT_TIMEOUT)


def compile_timeout() -> datetime.timedelta:
    """$NNSCALER_COMPILE_TIMEOUT seconds, else `DEFAULT_COMPILE_TIMEOUT`."""
    return _from_env("NNSCALER_COMPILE_TIMEOUT", DEFAULT_COMPILE_TIMEOUT)


def group_timeout(group: dist.ProcessGroup | None = None) -> datetime.timedelta:
    """The timeout `group` (default: the world) was created with; `DEFAULT_TIMEOUT` if unknown."""
    pg = group if group is not None else dist.group.WORLD
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            value = pg._get_backend(device).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
        if isinstance(value, datetime.timedelta) and value.total_seconds() > 0:
            return value
    return DEFAULT_TIMEOUT


def arrival_timeout(group: dist.ProcessGroup | None = None) -> datetime.timedelta:
    """$NNSCALER_ARRIVAL_TIMEOUT seconds, else the process-group timeout of `group`.

    Not shorter by default: a rank that is merely slow (an evaluation or a log on rank 0 before a
    checkpoint) would otherwise make a working job fail; the collective that follows would wait that
    long anyway. Set it lower to hear sooner about a missing rank."""
    return _from_env("NNSCALER_ARRIVAL_TIMEOUT", group_timeout(group))
