"""Random numbers under tensor parallelism.

Dropout on a replicated activation runs as plain F.dropout: every rank of a tensor-parallel group
draws from the default generator in the same order from the same seed, so their masks agree.
Dropout on a sharded activation must draw independent masks for the different shards, without
advancing the default generator (which would break the agreement above). It uses one extra
generator per (device, group rank), seeded from torch.initial_seed() and the rank in the group
(the same scheme as Megatron's model-parallel RNG tracker).
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.utils.checkpoint

from nnscaler.runtime.comm import Group, rank_in_group

__all__ = [
    "sharded_dropout",
    "shard_generator",
    "shard_rng",
    "recompute_contexts",
    "checkpoint",
    "shard_rng_states",
    "set_shard_rng_states",
]

_GENERATORS: dict[tuple[str, int], torch.Generator] = {}
_OFFSET = 2718  # keeps the shard streams apart from the default stream's seed


def shard_generator(device: torch.device, group: Group) -> torch.Generator:
    """This rank's generator for sharded random ops (created on first use)."""
    rank = rank_in_group(group)
    key = (str(device), rank)
    if key not in _GENERATORS:
        gen = torch.Generator(device=device)
        gen.manual_seed((torch.initial_seed() + _OFFSET + 1009 * (rank + 1)) % (2**63))
        _GENERATORS[key] = gen
    return _GENERATORS[key]


def shard_rng_states() -> dict[tuple[str, int], torch.Tensor]:
    """The state of every shard generator made so far, for checkpoints (resume draws the same masks)."""
    return {key: gen.get_state() for key, gen in _GENERATORS.items()}


def set_shard_rng_states(states: dict[tuple[str, int], torch.Tensor]) -> None:
    """Restore `shard_rng_states()` (generators not made yet are made with that state)."""
    for (device, rank), state in states.items():
        gen = _GENERATORS.setdefault((device, rank), torch.Generator(device=torch.device(device)))
        gen.set_state(state)


def sharded_dropout(x: torch.Tensor, p: float, training: bool, group: Group) -> torch.Tensor:
    """Dropout on this rank's shard with a mask independent of the other shards'."""
    if not training or p == 0.0:
        return x
    if p >= 1.0:
        return torch.zeros_like(x)
    keep = torch.empty_like(x).bernoulli_(1.0 - p, generator=shard_generator(x.device, group))
    return x * keep / (1.0 - p)


@contextlib.contextmanager
def shard_rng(group: Group, device: torch.device):
    """Run random ops that act on this rank's shard (e.g. attention dropout on its heads) with the
    shard generator as the default one, leaving the default stream exactly where it was."""
    if group is None or torch.distributed.get_world_size(group) == 1:
        yield
        return
    device = torch.device(device)
    gen = shard_generator(device, group)
    if device.type == "cuda":
        saved = torch.cuda.get_rng_state(device)
        torch.cuda.set_rng_state(gen.get_state(), device)
    else:
        saved = torch.get_rng_state()
        torch.set_rng_state(gen.get_state())
    try:
        yield
    finally:
        if device.type == "cuda":
            gen.set_state(torch.cuda.get_rng_state(device))
            torch.cuda.set_rng_state(saved, device)
        else:
            gen.set_state(torch.get_rng_state())
            torch.set_rng_state(saved)


def recompute_contexts(group: Group, device: torch.device):
    """`context_fn` for torch.utils.checkpoint around a region with sharded random ops: the
    recomputation in backward draws the same shard random numbers as the forward did.

    torch.utils.checkpoint restores the default generators only; this records the shard
    generator's state when the region's forward starts and sets it back for the recomputation.
    (A partial of a module-level function, not a closure: torch.compile can pass it on to
    `checkpoint` below, which runs eagerly.)
    """
    return functools.partial(_replaying_contexts, group, device)


def _replaying_contexts(group: Group, device: torch.device):
    if group is None or torch.distributed.get_world_size(group) == 1:
        return contextlib.nullcontext(), contextlib.nullcontext()
    gen = shard_generator(torch.device(device), group)
    at_forward = gen.get_state()

    @contextlib.contextmanager
    def replay():
        current = gen.get_state()
        gen.set_state(at_forward)
        try:
            yield
        finally:
            gen.set_state(current)

    return contextlib.nullcontext(), replay()


@torch.compiler.disable(
    reason="a recompute region drawing shard random numbers replays the shard generator through "
    "checkpoint's context_fn, which torch.compile's checkpoint does not support"
)
def checkpoint(function, *args, **kwargs):
    """`torch.utils.checkpoint.checkpoint` for the recompute regions that draw shard random numbers
    (generated code passes `context_fn=recompute_contexts(...)`). Under `ComputeConfig.torch_compile`
    the region runs eagerly (a graph break around it): dynamo's checkpoint takes no custom context_fn
    (it fails on one), and a traced region would not replay the shard generator."""
    return torch.utils.checkpoint.checkpoint(function, *args, **kwargs)
