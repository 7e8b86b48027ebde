"""A drill tool: corrupt one rank's gradients on purpose, to test (or demonstrate) robust aggregation.

    NNSCALER_FAULT_INJECT="rank=3,kind=sign_flip,scale=10,every=1" torchrun ... train.py

Inert unless the variable is set (the reducer reads it once, when it is built). On the named global
rank, every `every`-th aggregation round (optimizer step) from `start` on, each gradient bucket is
corrupted just before it is aggregated, after it holds the rank's (accumulated) local gradients:
- `sign_flip`: g -> -scale * g (a worker sending the wrong sign, or an attacker);
- `noise`: g -> g + scale * rms(g) * N(0, 1) (scaled Gaussian noise, a flaky device);
- `nan`: every value NaN (an overflow or a bit flip in the exponent);
- `stuck`: g -> the gradient of the first corrupted round, again and again (a stale buffer).
`scale` defaults to 1, `every` to 1, `start` to 0. Never set it in production runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from nnscaler import env_vars
from nnscaler.env_vars import FAULT_KINDS
from nnscaler.errors import ConfigError

__all__ = ["FAULT_ENV", "FAULT_KINDS", "FaultInjector", "from_env", "refuse_if_set"]

FAULT_ENV = "NNSCALER_FAULT_INJECT"


@dataclass
class FaultInjector:
    """Corrupts this rank's bucket values in the rounds `round % every == 0`, `round >= start`."""

    kind: str
    scale: float = 1.0
    every: int = 1
    start: int = 0
    _stuck: dict[int, torch.Tensor] = field(default_factory=dict)

    def active(self, round_: int) -> bool:
        return round_ >= self.start and (round_ - self.start) % self.every == 0

    @torch.no_grad()
    def corrupt(self, key: int, values: torch.Tensor, round_: int) -> None:
        """Corrupt `values` (one bucket's local contribution, `key` naming the bucket) in place."""
        if not self.active(round_):
            return
        if self.kind == "sign_flip":
            values.mul_(-self.scale)
        elif self.kind == "noise":
            rms = values.float().square().mean().sqrt()
            values.add_(torch.randn_like(values) * (self.scale * rms).to(values.dtype))
        elif self.kind == "nan":
            values.fill_(float("nan"))
        else:  # stuck
            if key not in self._stuck:
                self._stuck[key] = values.detach().clone()
            values.copy_(self._stuck[key])


def from_env(
    rank: int,
    environ: Mapping[str, str] | None = None,
    *,
    world_size: int | None = None,
    replicas: bool = True,
) -> FaultInjector | None:
    """The injector for global `rank` from $NNSCALER_FAULT_INJECT; None when unset or for another rank.

    The spec is checked by nnscaler.env_vars; here, where the run is known, a spec that cannot fire is
    refused (ConfigError): a named rank outside `range(world_size)`, or a run without data-parallel
    replicas (`replicas=False`: nothing is aggregated, so a drill there would pass without testing)."""
    spec = env_vars.read(FAULT_ENV, environ)
    if spec is None:
        return None
    text = env_vars.raw(FAULT_ENV, environ)
    if not replicas:
        refuse_if_set(
            "this run has no data-parallel replicas (runtime_ngpus == plan_ngpus): no gradient is "
            "aggregated across replicas. Run with runtime_ngpus a multiple (> 1) of plan_ngpus",
            environ,
        )
    if world_size is not None and max(spec["ranks"]) >= world_size:
        raise ConfigError(
            f"${FAULT_ENV}={text!r} names rank {max(spec['ranks'])}, but this run has {world_size} ranks "
            f"(0..{world_size - 1}): name a rank the run has, or unset it"
        )
    if rank not in spec["ranks"]:
        return None
    return FaultInjector(spec["kind"], spec["scale"], spec["every"], spec["start"])


def refuse_if_set(why: str, environ: Mapping[str, str] | None = None) -> None:
    """ConfigError when $NNSCALER_FAULT_INJECT is set on a run where it cannot fire (`why` says why)."""
    if env_vars.is_set(FAULT_ENV, environ):
        text = env_vars.raw(FAULT_ENV, environ)
        raise ConfigError(
            f"${FAULT_ENV}={text!r} is set, but the drill would corrupt nothing: {why}; or unset it"
        )
