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

import os
from dataclasses import dataclass, field

import torch

from nnscaler.errors import ConfigError

__all__ = ["FAULT_ENV", "FAULT_KINDS", "FaultInjector", "from_env"]

FAULT_ENV = "NNSCALER_FAULT_INJECT"
FAULT_KINDS = ("sign_flip", "noise", "nan", "stuck")


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


def _parse(text: str) -> dict[str, str]:
    out = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or not key:
            raise ConfigError(
                f"${FAULT_ENV}={text!r}: expected comma-separated key=value pairs, got {part!r}"
            )
        out[key.strip()] = value.strip()
    return out


def from_env(rank: int, environ: dict[str, str] | None = None) -> FaultInjector | None:
    """The injector for global `rank` from $NNSCALER_FAULT_INJECT; None when unset or for another rank."""
    text = (os.environ if environ is None else environ).get(FAULT_ENV, "").strip()
    if not text:
        return None
    spec = _parse(text)
    unknown = sorted(set(spec) - {"rank", "kind", "scale", "every", "start"})
    if unknown or "rank" not in spec or spec.get("kind") not in FAULT_KINDS:
        raise ConfigError(
            f"${FAULT_ENV}={text!r}: give rank=<global rank>,kind=<{'|'.join(FAULT_KINDS)}> and optionally "
            f"scale=<float>,every=<steps>,start=<step>" + (f" (unknown keys {unknown})" if unknown else "")
        )
    try:
        ranks = {int(r) for r in spec["rank"].split("+")}
        inj = FaultInjector(
            spec["kind"], float(spec.get("scale", 1)), int(spec.get("every", 1)), int(spec.get("start", 0))
        )
    except ValueError as err:
        raise ConfigError(f"${FAULT_ENV}={text!r}: {err}") from None
    if inj.every < 1:
        raise ConfigError(f"${FAULT_ENV}={text!r}: every must be >= 1")
    return inj if rank in ranks else None
