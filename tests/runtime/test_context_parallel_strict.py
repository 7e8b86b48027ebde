"""Context-parallel attention in the NCCL-like strict P2P mode (NNSCALER_STRICT_P2P=1): every ring
exchange carries a header checked on arrival. Every kind passes on 4 gloo ranks; a ring whose ranks
run different exchanges (one rank starts a second forward while the others run the backward) fails
with P2POrderError naming both exchanges instead of training on swapped blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nnscaler.runtime.dist.p2p import STRICT_ENV
from tests.dist_util import SpawnError, spawn


def _inputs(rank: int, world: int, s: int = 64):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, s, 8, generator=g, dtype=torch.float64) for _ in range(3))
    rows = slice(rank * s // world, (rank + 1) * s // world)
    local = [t[:, :, rows].clone().requires_grad_() for t in (q, k, v)]
    return (q, k, v), local, rows


def _every_kind(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from nnscaler.runtime.context_parallel import context_parallel_attention, hybrid_subgroups
    from nnscaler.runtime.dist.groups import create_groups, get_group

    create_groups([list(range(world)), *hybrid_subgroups(list(range(world)), 2)])
    group = get_group(list(range(world)))
    (q, k, v), _, rows = _inputs(rank, world)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, rows]
    errors = {}
    for kind in ("zigzag", "ring", "ulysses", "hybrid"):
        _, local, _ = _inputs(rank, world)
        out = context_parallel_attention(*local, is_causal=True, group=group, kind=kind, ulysses_size=2)
        out.sum().backward()
        errors[kind] = float((out - ref).abs().max())
    dist.barrier()
    return errors


def test_every_kind_passes_strict_mode(tmp_path, monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "1")
    for errors in spawn(_every_kind, 4, tmp_path, timeout=120):
        assert all(e < 1e-12 for e in errors.values()), errors


def _misordered(rank: int, world: int) -> None:
    from nnscaler.runtime.context_parallel import context_parallel_attention
    from nnscaler.runtime.dist.groups import create_groups, get_group

    create_groups([list(range(world))])
    group = get_group(list(range(world)))
    _, local, _ = _inputs(rank, world)
    out = context_parallel_attention(*local, is_causal=True, group=group, kind="ring")
    if rank == 1:  # this rank runs a second forward where the others run the first backward
        _, again, _ = _inputs(rank, world)
        context_parallel_attention(*again, is_causal=True, group=group, kind="ring")
    out.sum().backward()


def test_a_misordered_ring_fails_in_strict_mode(tmp_path, monkeypatch):
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(
        SpawnError,
        match=r"ring out of order.*forward kv exchange.*backward kv exchange|ring out of order.*backward kv exchange.*forward kv exchange",
    ):
        spawn(_misordered, 4, tmp_path, timeout=60)
