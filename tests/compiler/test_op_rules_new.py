"""Rules for functional writes (slice_scatter, copy, scatter, index_put, ...), unequal splits and
grouped convolutions: for every split a rule allows (2 and 3 ways), the partitioned program gives
the whole op's result.

Each case captures a one-op module, plans that node split on each identifier `split_candidates`
offers, and runs the program `apply_plan` builds rank by rank in this process: op statements are
the generated code's own lines (`statement_code`), communication is the change of layout it stands
for (gather the producer's pieces, cut the consumer's). The ranks' outputs must equal the op's
output on whole tensors, and each local tensor must have the shape partition says it has.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree

from nnscaler.graph.capture import capture
from nnscaler.graph.ir import Layout, Partial, Replicate, Shard, map_refs
from nnscaler.graph.ops import annotate_node, split_candidates
from nnscaler.partition import apply_plan
from nnscaler.policies import NodePlan, Plan
from tests.parity import ParityCase, run_parity_many

A = torch.ops.aten
MAXINT = 9223372036854775807


class OneOp(torch.nn.Module):
    def __init__(self, fn: Callable[..., Any]):
        super().__init__()
        self.fn = fn

    def forward(self, **inputs: torch.Tensor) -> Any:
        return self.fn(**inputs)


# ---- layouts on whole tensors ------------------------------------------------------------------
def _shard(full: torch.Tensor, layout: Layout, rank: int, ways: int) -> torch.Tensor:
    if isinstance(layout, Replicate):
        return full
    if isinstance(layout, Shard):
        blocks = full.unflatten(layout.dim, (layout.blocks, ways, -1))
        return blocks.select(layout.dim + 1, rank).flatten(layout.dim, layout.dim + 1)
    raise AssertionError(f"no conversion into {layout} in these programs")


def _merge(pieces: list[torch.Tensor], layout: Layout) -> torch.Tensor:
    if isinstance(layout, Replicate):
        for p in pieces[1:]:
            torch.testing.assert_close(p, pieces[0], rtol=0, atol=0)
        return pieces[0]
    if isinstance(layout, Partial):
        return torch.stack(pieces).sum(0)
    if isinstance(layout, Shard):
        d = layout.dim
        blocks = [p.unflatten(d, (layout.blocks, -1)) for p in pieces]
        return torch.stack(blocks, d + 1).flatten(d, d + 2)
    raise AssertionError(f"unknown layout {layout}")


def _simulate(program, inputs: dict[str, torch.Tensor], ways: int) -> list[Any]:
    """Every rank's outputs, running the program's statements in lockstep."""
    from nnscaler.codegen.expr import Formatter, statement_code

    envs = [dict(inputs) for _ in range(ways)]
    ns = {"torch": torch, "F": F, "self": types.SimpleNamespace(device=torch.device("cpu"))}
    for s in program.statements:
        if s.kind == "comm":
            src, (out,) = s.args[0].name, s.outputs
            src_layout, dst_layout = program.layouts[src], program.layouts[out]
            if src_layout == dst_layout:  # f: identity forward
                for env in envs:
                    env[out] = env[src]
                continue
            pieces = [env[src] for env in envs]
            full = pieces[0] if isinstance(src_layout, Replicate) else _merge(pieces, src_layout)
            for rank, env in enumerate(envs):
                env[out] = _shard(full, dst_layout, rank, ways)
            continue
        assert s.kind in ("op", "scale", "bias"), f"{s.kind} {s.op} is not simulated here"
        for rank, env in enumerate(envs):
            exec(statement_code(s, Formatter(rank, set())), ns, env)
            for name in s.outputs:
                meta = program.local_meta.get(name)
                if meta is not None and isinstance(env[name], torch.Tensor):
                    assert tuple(env[name].shape) == tuple(meta.shape), (
                        f"{s.op}: local {name} has shape {tuple(env[name].shape)}, partition says {meta.shape}"
                    )
    return [map_refs(program.outputs, lambda r, env=env: env[r.name]) for env in envs]


def check_splits(fn: Callable[..., Any], inputs: dict[str, torch.Tensor], op: str, ways: int) -> list[str]:
    """Split the `op` node of `fn` on every identifier its rule allows; return those identifiers."""
    graph = capture(OneOp(fn), inputs, static_shapes=True, both_modes=False)
    node = next(n for n in graph.nodes if n.op == op)
    bound = annotate_node(node, graph)
    assert bound is not None, f"{op} has no rule"
    want = pytree.tree_leaves(fn(**inputs))
    idents = split_candidates(bound, ways)
    for ident in idents:
        program = apply_plan(graph, Plan("test", ways, {node.name: NodePlan(ident, ways)}))
        for rank, out in enumerate(_simulate(program, inputs, ways)):
            got = pytree.tree_leaves(out)
            assert len(got) == len(want)
            for g, w in zip(got, want):
                torch.testing.assert_close(
                    g, w, msg=lambda m, i=ident, r=rank: f"'{bound}' on {i}/{ways} rank {r}: {m}"
                )
    return idents


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(sum(shape) + len(shape)))


def unique_index(rows: int, length: int, count: int) -> torch.Tensor:
    """Per row, `count` distinct positions below `length` (scatter without reduction needs distinct)."""
    g = _gen(rows * 31 + length)
    return torch.stack([torch.randperm(length, generator=g)[:count] for _ in range(rows)])


# ---- cases: (id, fn, inputs, op, identifiers allowed 2 ways, 3 ways) ---------------------------
x3 = randn(6, 12, 6)
CASES = [
    # functional writes
    ("slice_scatter", lambda x, y: A.slice_scatter.default(x, y, 1, 2, 5), dict(x=x3, y=randn(6, 3, 6)),
     "aten.slice_scatter.default", ["a", "c"], ["a", "c"]),
    ("slice_scatter_step", lambda x, y: A.slice_scatter.default(x, y, -2, 1, 9, 2), dict(x=x3, y=randn(6, 4, 6)),
     "aten.slice_scatter.default", ["a", "c"], ["a", "c"]),
    ("slice_scatter_all", lambda x, y: A.slice_scatter.default(x, y, 1, 0, MAXINT), dict(x=x3, y=randn(6, 12, 6)),
     "aten.slice_scatter.default", ["a", "b", "c"], ["a", "b", "c"]),
    ("slice_scatter_all_end", lambda x, y: A.slice_scatter.default(x, y, 1, 0, 12), dict(x=x3, y=randn(6, 12, 6)),
     "aten.slice_scatter.default", ["a", "b", "c"], ["a", "b", "c"]),
    ("select_scatter", lambda x, y: A.select_scatter.default(x, y, 1, -1), dict(x=x3, y=randn(6, 6)),
     "aten.select_scatter.default", ["a", "c"], ["a", "c"]),
    ("copy_broadcast", lambda x, y: A.copy.default(x, y), dict(x=x3, y=randn(12, 1)),
     "aten.copy.default", ["a", "b", "c"], ["a", "b", "c"]),
    ("copy_dtype", lambda x, y: A.copy.default(x, y), dict(x=x3, y=randn(6, 12, 6).double()),
     "aten.copy.default", ["a", "b", "c"], ["a", "b", "c"]),
    ("fill_scalar", lambda x: A.fill.Scalar(x, 2.5), dict(x=x3), "aten.fill.Scalar", ["a", "b", "c"], ["a", "b", "c"]),
    ("fill_tensor", lambda x, v: A.fill.Tensor(x, v), dict(x=x3, v=torch.tensor(1.5)),
     "aten.fill.Tensor", ["a", "b", "c"], ["a", "b", "c"]),
    ("zero", lambda x: A.zero.default(x), dict(x=x3), "aten.zero.default", ["a", "b", "c"], ["a", "b", "c"]),
    ("scatter_value", lambda x, i: A.scatter.value(x, 1, i, 1.0), dict(x=randn(6, 12), i=unique_index(6, 12, 3)),
     "aten.scatter.value", ["a"], ["a"]),
    ("scatter_src", lambda x, i, s: A.scatter.src(x, 1, i, s),
     dict(x=randn(6, 12), i=unique_index(6, 12, 4), s=randn(6, 5)), "aten.scatter.src", ["a"], ["a"]),
    ("scatter_src_dim0", lambda x, i, s: A.scatter.src(x, 0, i, s),
     dict(x=randn(12, 6), i=unique_index(6, 12, 4).T.contiguous(), s=randn(4, 6)), "aten.scatter.src", ["b"], ["b"]),
    ("scatter_short_index", lambda x, i, s: A.scatter.src(x, 1, i, s),
     dict(x=randn(6, 12), i=unique_index(3, 12, 4), s=randn(6, 4)), "aten.scatter.src", [], []),
    ("scatter_reduce", lambda x, i, s: A.scatter.reduce(x, 1, i, s, reduce="add"),
     dict(x=randn(6, 12), i=torch.randint(0, 12, (6, 7), generator=_gen()), s=randn(6, 7)), "aten.scatter.reduce", ["a"], ["a"]),
    ("scatter_value_reduce", lambda x, i: A.scatter.value_reduce(x, 1, i, 3.0, reduce="multiply"),
     dict(x=randn(6, 12), i=torch.randint(0, 12, (6, 5), generator=_gen())), "aten.scatter.value_reduce", ["a"], ["a"]),
    ("scatter_add", lambda x, i, s: A.scatter_add.default(x, 1, i, s),
     dict(x=randn(6, 12), i=torch.randint(0, 12, (6, 7), generator=_gen()), s=randn(6, 7)), "aten.scatter_add.default", ["a"], ["a"]),
    ("scatter_reduce_two", lambda x, i, s: A.scatter_reduce.two(x, 1, i, s, "amax"),
     dict(x=randn(6, 12), i=torch.randint(0, 12, (6, 7), generator=_gen()), s=randn(6, 7)), "aten.scatter_reduce.two", ["a"], ["a"]),
    ("index_copy", lambda x, i, s: A.index_copy.default(x, 1, i, s),
     dict(x=x3, i=torch.tensor([7, 0, 3, 10]), s=randn(6, 4, 6)), "aten.index_copy.default", ["a", "c"], ["a", "c"]),
    ("index_add", lambda x, i, s: A.index_add.default(x, 1, i, s, alpha=2.0),
     dict(x=x3, i=torch.tensor([7, 0, 7, 10]), s=randn(6, 4, 6)), "aten.index_add.default", ["a", "c"], ["a", "c"]),
    ("index_put_mid", lambda x, i, v: A.index_put.default(x, [None, i], v),
     dict(x=x3, i=torch.tensor([1, 3]), v=randn(6, 2, 6)), "aten.index_put.default", ["a", "c"], ["a", "c"]),
    ("index_put_first_broadcast", lambda x, i, v: A.index_put.default(x, [i], v),
     dict(x=x3, i=torch.tensor([5, 2, 0]), v=randn(6)), "aten.index_put.default", ["b", "c"], ["b", "c"]),
    ("index_put_accumulate", lambda x, i, v: A.index_put.default(x, [None, i], v, True),
     dict(x=x3, i=torch.tensor([1, 1, 4]), v=randn(6, 3, 1)), "aten.index_put.default", ["a", "c"], ["a", "c"]),
    ("index_put_apart", lambda x, i, j, v: A.index_put.default(x, [i, None, j], v),
     dict(x=randn(4, 6, 8, 6), i=torch.tensor([0, 3]), j=torch.tensor([7, 2]), v=randn(2, 6, 6)),
     "aten.index_put.default", ["b", "d"], ["b", "d"]),
    ("index_put_mask", lambda x, m, v: A.index_put.default(x, [m], v),
     dict(x=randn(6, 12, 6), m=randn(6, 12) > 0, v=randn(6)), "aten.index_put.default", ["c"], ["c"]),
    ("diagonal_scatter", lambda x, y: A.diagonal_scatter.default(x, y, 1, 1, 2),
     dict(x=randn(6, 4, 4), y=randn(6, 3)), "aten.diagonal_scatter.default", ["a"], ["a"]),
    ("as_strided_scatter", lambda x, y: A.as_strided_scatter.default(x, y, [3, 2], [4, 1], 1),
     dict(x=randn(6, 4), y=randn(3, 2)), "aten.as_strided_scatter.default", [], []),
    # pieces along one dim
    ("split_unequal", lambda x: torch.split(x, [4, 6, 2], dim=-1), dict(x=randn(6, 12, 12)),
     "aten.split_with_sizes.default", ["a", "b"], ["a", "b"]),
    ("split_sizes_equal", lambda x: torch.split(x, [6, 6], dim=1), dict(x=randn(6, 12)),
     "aten.split_with_sizes.default", ["a", "b"], ["a", "b"]),
    ("split_size_ragged", lambda x: torch.split(x, 5, dim=1), dict(x=randn(6, 12)),
     "aten.split.Tensor", ["a"], ["a"]),
    ("split_size_equal", lambda x: torch.split(x, 6, dim=1), dict(x=randn(6, 12)),
     "aten.split.Tensor", ["a", "b"], ["a", "b"]),
    ("chunk_ragged", lambda x: torch.chunk(x, 3, dim=0), dict(x=randn(8, 6)), "aten.chunk.default", ["b"], ["b"]),
    ("chunk_equal", lambda x: torch.chunk(x, 2, dim=1), dict(x=randn(6, 12)), "aten.chunk.default", ["a", "b"], ["a", "b"]),
    ("unbind", lambda x: torch.unbind(x, 1), dict(x=randn(6, 3, 12)), "aten.unbind.int", ["a", "c"], ["a", "c"]),
    ("tensor_split_sections", lambda x: torch.tensor_split(x, 2, dim=1), dict(x=randn(6, 12)),
     "aten.tensor_split.sections", ["a", "b"], ["a", "b"]),
    ("tensor_split_indices", lambda x: torch.tensor_split(x, [2, 7], dim=1), dict(x=randn(6, 12)),
     "aten.tensor_split.indices", ["a"], ["a"]),
    # convolutions
    ("conv1d_depthwise_bias", lambda x, w, b: F.conv1d(x, w, b, padding=3, groups=12),
     dict(x=randn(6, 12, 8), w=randn(12, 1, 4), b=randn(12)), "aten.conv1d.default", ["n", "g"], ["n", "g"]),
    ("conv2d_grouped", lambda x, w: F.conv2d(x, w, groups=2, padding=1),
     dict(x=randn(6, 4, 5, 5), w=randn(6, 2, 3, 3)), "aten.conv2d.default", ["n", "g", "ci"], ["n", "co"]),
    ("conv2d_grouped_bias", lambda x, w, b: F.conv2d(x, w, b, groups=3),
     dict(x=randn(6, 6, 4, 4), w=randn(12, 2, 3, 3), b=randn(12)), "aten.conv2d.default", ["n", "ci", "co"], ["n", "g"]),
    ("conv1d_plain", lambda x, w: F.conv1d(x, w), dict(x=randn(6, 6, 5), w=randn(12, 6, 3)),
     "aten.conv1d.default", ["n", "c", "o"], ["n", "c", "o"]),
    ("conv_transpose1d", lambda x, w, b: F.conv_transpose1d(x, w, b, stride=2),
     dict(x=randn(6, 6, 5), w=randn(6, 12, 3), b=randn(12)), "aten.conv_transpose1d.default", ["n", "c", "o"],
     ["n", "c", "o"]),
    ("conv_transpose2d_grouped", lambda x, w: F.conv_transpose2d(x, w, groups=2),
     dict(x=randn(6, 8, 3, 3), w=randn(8, 3, 2, 2)), "aten.conv_transpose2d.input", ["n", "g", "ci"], ["n", "co"]),
    ("convolution_grouped", lambda x, w, b: A.convolution.default(x, w, b, [1], [1], [1], False, [0], 2),
     dict(x=randn(6, 4, 7), w=randn(6, 2, 3), b=randn(6)), "aten.convolution.default", ["n", "g", "ci"], ["n", "co"]),
    ("convolution_transposed", lambda x, w: A.convolution.default(x, w, None, [2], [0], [1], True, [1], 3),
     dict(x=randn(6, 6, 4), w=randn(6, 2, 3)), "aten.convolution.default", ["n", "ci", "co"], ["n", "g"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("fn", "inputs", "op", "two", "three"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_split_then_merge_equals_whole(fn, inputs, op, two, three):
    assert check_splits(fn, inputs, op, 2) == two
    assert check_splits(fn, inputs, op, 3) == three


def test_model_of_writes_trains_like_one_device(tmp_path):
    """Slice/select writes, scatter_add, index_put, an unequal split and a depthwise conv1d in one model,
    compiled for 2 devices under `tp`, `data` and a policy that splits each op on its last identifier
    (conv on its groups, slice_scatter on the sequence, ...): each trains like the single-device model."""
    model = "tests.models_writes:build_writes"
    cases = [
        ParityCase(model, "tp", 2),
        ParityCase(model, "data", 2),
        ParityCase(model, "tests.models_writes.pas_last", 2),
    ]
    run_parity_many(cases, 2, tmp_path=tmp_path)
