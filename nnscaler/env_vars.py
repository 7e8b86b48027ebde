"""Every environment variable nnscaler reads, with the parser that checks its value.

    from nnscaler import env_vars
    seconds = env_vars.read("NNSCALER_TIMEOUT")   # None when unset or empty; a float otherwise

A read of a variable that is not in `REGISTRY` is a programming error (KeyError), and
tests/settings/test_env_table.py fails on any `os.environ` read elsewhere in nnscaler. A bad value
raises `ConfigError` naming the variable, the value and what to set instead. This module imports only
nnscaler.errors, so the runtime (and nnscaler.logs) may use it.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from nnscaler.errors import ConfigError

__all__ = ["EnvVar", "REGISTRY", "FAULT_KINDS", "read", "raw", "is_set"]

FAULT_KINDS = ("sign_flip", "noise", "nan", "stuck")
"""The corruptions of NNSCALER_FAULT_INJECT (nnscaler.runtime.grads.fault_inject)."""


@dataclass(frozen=True)
class EnvVar:
    """One variable: its parser (raises ValueError with the reason) and what a good value looks like."""

    name: str
    parse: Callable[[str], Any]
    fix: str
    """How to set it right, e.g. 'a positive number of seconds, e.g. 600'."""
    doc: str
    """What it does and its default."""


def _number(raw: str, kind: type) -> Any:
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"not {'an integer' if kind is int else 'a number'}") from None


def _seconds(raw: str) -> float:
    value = _number(raw, float)
    if not math.isfinite(value) or value <= 0:
        raise ValueError("not a positive, finite number")
    return value


def _positive_float(raw: str) -> float:
    return _seconds(raw)


def _positive_int(raw: str) -> int:
    value = _number(raw, int)
    if value < 1:
        raise ValueError("not a positive integer")
    return value


def _count(raw: str) -> int:
    value = _number(raw, int)
    if value < 0:
        raise ValueError("negative (a count is 0 or more)")
    return value


def _rank(raw: str) -> int:
    value = _number(raw, int)
    if value < 0:
        raise ValueError("negative (a rank is 0 or more)")
    return value


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError("not a switch")


def _choice(*choices: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        if raw.lower() not in choices:
            raise ValueError(f"not one of {', '.join(choices)}")
        return raw.lower()

    return parse


def _log_level(raw: str) -> int:
    level = logging.getLevelName(raw.upper())
    if not isinstance(level, int):
        raise ValueError("not a logging level")
    return level


def _text(raw: str) -> str:
    return raw


def _fault_fields(raw: str) -> dict[str, Any]:
    spec: dict[str, str] = {}
    for part in raw.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or not key.strip():
            raise ValueError(f"expected comma-separated key=value pairs, got {part!r}")
        spec[key.strip()] = value.strip()
    unknown = sorted(set(spec) - {"rank", "kind", "scale", "every", "start"})
    if unknown:
        raise ValueError(f"unknown keys {unknown}")
    if "rank" not in spec or "kind" not in spec:
        raise ValueError("rank and kind are required")
    if spec["kind"] not in FAULT_KINDS:
        raise ValueError(f"kind {spec['kind']!r} is not one of {'|'.join(FAULT_KINDS)}")
    ranks = {int(r) for r in spec["rank"].split("+")}
    if min(ranks) < 0:
        raise ValueError(f"rank {min(ranks)} is negative")
    scale = float(spec.get("scale", 1))
    if not math.isfinite(scale):
        raise ValueError(f"scale {scale} is not finite")
    every, start = int(spec.get("every", 1)), int(spec.get("start", 0))
    if every < 1:
        raise ValueError("every must be >= 1")
    if start < 0:
        raise ValueError("start must be >= 0")
    return {"ranks": ranks, "kind": spec["kind"], "scale": scale, "every": every, "start": start}


def _fault_spec(raw: str) -> dict[str, Any]:
    """`rank=3,kind=sign_flip,scale=10,every=1,start=0` -> {"ranks": {3}, "kind": ..., ...}."""
    try:
        return _fault_fields(raw)
    except ValueError as err:
        raise ValueError(f"not a fault spec ({err})") from None


_SECONDS_FIX = "a positive number of seconds, e.g. 600"
_VARS = [
    EnvVar("NNSCALER_TIMEOUT", _seconds, _SECONDS_FIX, "Collective timeout of nnscaler.init (default 600)."),
    EnvVar(
        "NNSCALER_COMPILE_TIMEOUT", _seconds, _SECONDS_FIX, "How long ranks wait for rank 0's compile (3600)."
    ),
    EnvVar(
        "NNSCALER_ARRIVAL_TIMEOUT", _seconds, _SECONDS_FIX, "Wait at meeting points (the group's timeout)."
    ),
    EnvVar(
        "NNSCALER_HEARTBEAT_TIMEOUT", _seconds, _SECONDS_FIX, "Trainer: a peer silent this long is dead (30)."
    ),
    EnvVar(
        "NNSCALER_STRICT_P2P_TIMEOUT", _seconds, _SECONDS_FIX, "Strict P2P: wait for the peer's receive (60)."
    ),
    EnvVar(
        "NNSCALER_STRICT_P2P",
        _flag,
        "1 (on) or 0 (off); also true/false, yes/no, on/off",
        "Checked P2P order with synchronous sends (default off).",
    ),
    EnvVar(
        "NNSCALER_AUTODIST_NATIVE",
        _flag,
        "1 (build the C++ pipeline search) or 0 (pure Python)",
        "autodist's pipeline search in C++ when a compiler is present (default on).",
    ),
    EnvVar(
        "NNSCALER_BACKEND",
        _choice("nccl", "gloo"),
        "nccl or gloo (or unset: nccl with CUDA, else gloo)",
        "Process-group backend of nnscaler.init.",
    ),
    EnvVar(
        "NNSCALER_LOG",
        _log_level,
        "a logging level: debug, info, warning or error",
        "Level of the `nnscaler` logger (unset: quiet).",
    ),
    EnvVar(
        "NNSCALER_TIMELINE",
        _text,
        "a file path (one file per rank is written next to it)",
        "Record every collective and P2P op into this file (any path is accepted; written at exit).",
    ),
    EnvVar(
        "NNSCALER_NODE_SIZE",
        _positive_int,
        "the ranks per node, a positive divisor of the world size, e.g. 8",
        "Ranks per node for the hierarchical all-reduce (default $LOCAL_WORLD_SIZE, else the world).",
    ),
    EnvVar(
        "NNSCALER_INTRA_NODE_GBPS",
        _positive_float,
        "a positive bandwidth in GB/s, e.g. 300",
        "Intra-node bandwidth for the hierarchical all-reduce's cost rule (300 on CUDA, else 10).",
    ),
    EnvVar(
        "NNSCALER_INTER_NODE_GBPS",
        _positive_float,
        "a positive bandwidth in GB/s, e.g. 50",
        "Inter-node bandwidth for the hierarchical all-reduce's cost rule (50 on CUDA, else 10).",
    ),
    EnvVar(
        "NNSCALER_FAULT_INJECT",
        _fault_spec,
        f"rank=<global rank>[+rank...],kind=<{'|'.join(FAULT_KINDS)}>[,scale=<float>][,every=<steps >= 1>]"
        "[,start=<step >= 0>], e.g. rank=1,kind=sign_flip",
        "A drill: corrupt one rank's gradients (nnscaler.runtime.grads.fault_inject).",
    ),
    # set by torchrun (torch.distributed.run); read where no process group tells us yet
    EnvVar("RANK", _rank, "a rank >= 0 (torchrun sets it)", "This process's global rank."),
    EnvVar("LOCAL_RANK", _rank, "a rank >= 0 (torchrun sets it)", "This process's rank on its node."),
    EnvVar("WORLD_SIZE", _positive_int, "a positive number of processes (torchrun sets it)", "Processes."),
    EnvVar(
        "LOCAL_WORLD_SIZE", _positive_int, "a positive number of processes per node", "Processes per node."
    ),
    EnvVar("CUDA_VISIBLE_DEVICES", _text, "CUDA's device list", "Quoted in error messages only (any text)."),
    EnvVar(
        "TORCH_NCCL_ENABLE_TIMING",
        _flag,
        "1 or 0",
        "torch's NCCL timing switch; the timeline turns it on when it is unset.",
    ),
    # elastic training (nnscaler.cli.elastic; docs/elastic.md)
    EnvVar(
        "NNSCALER_SNAPSHOT_DIR",
        _text,
        "a directory, on tmpfs for host memory, e.g. /dev/shm/snapshots",
        "This node's in-memory snapshot directory when TrainerArgs.snapshot_dir is not set.",
    ),
    EnvVar(
        "TORCHELASTIC_RESTART_COUNT",
        _count,
        "a count >= 0 (torchrun's elastic agent sets it)",
        "How many times the agent restarted the workers after a failure.",
    ),
    EnvVar(
        "TORCHELASTIC_MAX_RESTARTS",
        _count,
        "a count >= 0 (torchrun's --max-restarts)",
        "How many restarts the agent allows; above 0 turns in-memory snapshots on by default.",
    ),
    EnvVar("TORCHELASTIC_RUN_ID", _text, "torchrun's --rdzv-id", "Names the run's snapshot directory."),
    EnvVar(
        "TORCHELASTIC_USE_AGENT_STORE",
        _flag,
        "True or False (torchrun sets it)",
        "The workers share the agent's rendezvous store (a restarted round may then fail to connect).",
    ),
]
REGISTRY: dict[str, EnvVar] = {v.name: v for v in _VARS}


def is_set(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether registered variable `name` is set to a non-empty value."""
    REGISTRY[name]  # noqa: B018 (an unregistered name is a programming error)
    return bool((os.environ if environ is None else environ).get(name, "").strip())


def raw(name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The text of registered variable `name` as set (stripped; None when unset or empty), for messages."""
    REGISTRY[name]  # noqa: B018 (an unregistered name is a programming error)
    return (os.environ if environ is None else environ).get(name, "").strip() or None


def read(name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The parsed value of registered variable `name`; None when it is unset or empty.

    Raises ConfigError naming the variable, its value, why it is wrong and what to set."""
    var = REGISTRY[name]
    raw = (os.environ if environ is None else environ).get(name, "").strip()
    if not raw:
        return None
    try:
        return var.parse(raw)
    except (ValueError, TypeError) as err:
        raise ConfigError(
            f"environment variable {name}={raw!r} is {err}: set it to {var.fix}, or unset it"
        ) from None
