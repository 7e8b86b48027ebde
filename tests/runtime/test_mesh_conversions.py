"""Every conversion between 1-D and 2-D layouts on a 2 x 2 mesh of real gloo ranks: the collectives
`conversion_steps` picks (one axis at a time, nested shards in order) leave each rank holding exactly
its piece of the destination layout."""

from __future__ import annotations

import itertools

import torch

from nnscaler.graph.ir import MeshLayout, Partial, Replicate, Shard, mesh_coords, placements_of
from nnscaler.mesh import mesh_axis_groups, rank_axis_groups
from nnscaler.partition import GROUP, AxisGroup, conversion_steps
from nnscaler.runtime import comm
from nnscaler.runtime.dist.groups import create_groups, get_group

try:
    from .dist_util import run_dist
except ImportError:
    from dist_util import run_dist

MESH = (2, 2)
R, P = Replicate(), Partial()
LAYOUTS = [
    R,
    P,
    Shard(0),
    Shard(1),
    Shard(1, blocks=3),
    MeshLayout((Shard(0), Shard(1))),
    MeshLayout((Shard(1), Shard(0))),
    MeshLayout((R, Shard(0))),
    MeshLayout((Shard(0), R)),
    MeshLayout((Shard(2), R)),
    MeshLayout((R, Shard(1, blocks=3))),
    MeshLayout((Shard(0), P)),
    MeshLayout((P, Shard(1))),
    MeshLayout((P, R)),
    MeshLayout((R, P)),
]


def local_piece(x: torch.Tensor, layout, rank: int) -> torch.Tensor:
    """What `rank` holds of the global tensor x: axis 0's placement applied first, then axis 1's
    (nested shards); a partial axis gives this rank (coordinate + 1) / 3 of the value (they sum to x)."""
    coords = mesh_coords(rank, MESH)
    for k, p in enumerate(placements_of(layout, len(MESH))):
        if isinstance(p, Shard):
            blocks = x.chunk(p.blocks, dim=p.dim)
            x = torch.cat([b.chunk(MESH[k], dim=p.dim)[coords[k]] for b in blocks], dim=p.dim)
        elif isinstance(p, Partial):
            x = x * (coords[k] + 1) / 3
    return x


def _run_steps(x: torch.Tensor, steps, groups: dict) -> torch.Tensor:
    for step in steps:
        args = [groups[a] if a is GROUP or isinstance(a, AxisGroup) else a for a in step.args]
        x = getattr(comm, step.fn)(x, *args, **dict(step.kwargs))
    return x


def check_all_conversions(rank: int, world_size: int) -> int:
    ranks = list(range(world_size))
    create_groups([ranks] + [g for axis in mesh_axis_groups(ranks, MESH) for g in axis])
    named = rank_axis_groups(ranks, MESH, rank)
    groups = {
        GROUP: get_group(ranks),
        AxisGroup(0): get_group(named["tp_axis0"]),
        AxisGroup(1): get_group(named["tp_axis1"]),
    }
    x = torch.randn(4, 12, 8, generator=torch.Generator().manual_seed(0))
    checked = 0
    for src, dst in itertools.product(LAYOUTS, LAYOUTS):
        if isinstance(dst, Partial) or (isinstance(dst, MeshLayout) and P in dst.placements):
            continue  # nothing converts into a partial sum
        steps = conversion_steps(src, dst, len(MESH))
        got = _run_steps(local_piece(x, src, rank), steps, groups)
        want = local_piece(x, dst, rank)
        path = " -> ".join(f"{s.fn}{s.args[1:] if s.args else ()}" for s in steps)
        what = f"{src} -> {dst} via [{path}] on rank {rank}"
        torch.testing.assert_close(got, want, msg=lambda m, what=what: f"{what}: {m}")
        assert str(steps[-1].result if steps else src) == str(dst) or src == dst
        checked += 1
    return checked


def test_every_conversion_on_a_2x2_mesh():
    counts = run_dist(check_all_conversions, 4, timeout=120)
    assert counts[0] == counts[3] > 100


def test_nested_shards_convert_inner_axis_first():
    # (R, S(0)) -> S(0): axis 0 may not shard dim 0 while axis 1 holds its (outer) shard of it
    steps = conversion_steps(MeshLayout((R, Shard(0))), Shard(0), 2)
    assert [(s.fn, s.args[-1]) for s in steps][0] == ("gather_from_group", AxisGroup(1))
    # 1-D layouts keep converting over the whole group in one collective
    assert [(s.fn, s.args) for s in conversion_steps(Shard(0), R, 2)] == [("gather_from_group", (0, GROUP))]
    # a shard of one dim to another on one axis is one all-to-all over that axis
    steps = conversion_steps(MeshLayout((Shard(0), Shard(1))), MeshLayout((Shard(0), Shard(2))), 2)
    assert [(s.fn, s.args) for s in steps] == [("all_to_all_in_group", (1, 2, AxisGroup(1)))]
