"""Every registered op rule, proven on random inputs: the op computed whole equals the op split per
its rule (every identifier `split_candidates` allows, 2 and 3 ways, and 2 ways in 2 strided blocks),
computed piece by piece and merged. A registered op without a case fails, so no rule skips this.

Each case is a one-node Graph; `apply_plan` builds the split node's local calls exactly as for a real
model (input slices, localised shape and group arguments, specials, bias after the reduction, mean
scaling); the ranks run those statements in this process (one after the other, or as threads where
a runtime helper communicates, over `_SimDist`, a stand-in for the few torch.distributed calls
nnscaler.runtime.comm makes); each output is merged per its layout (Shard: concatenated, Partial:
summed, Replicate: every rank equal) and compared with the whole op (float64 where the op allows,
tight tolerance). A rule with no split runs whole on every rank, so its shape inference is checked
against the traced shapes. Sample arguments: op_fuzz_cases.py and op_fuzz_view_cases.py.
"""

from __future__ import annotations

import threading
import zlib
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist

import nnscaler.runtime.chunked_loss as chunked_loss
import nnscaler.runtime.comm as comm
import nnscaler.runtime.rng as rng
from nnscaler.graph.ir import Graph, GraphBuilder, Node, Partial, Ref, Replicate, Shard, TensorMeta, Value
from nnscaler.graph.ops import all_rules, annotate_node, get_rule, layouts_for, split_candidates
from nnscaler.partition import GROUP, RankScaled, apply_plan
from nnscaler.policies import Plan
from nnscaler.policies.plan import NodePlan
from nnscaler.runtime.shard import assemble_shards
from tests.compiler.op_fuzz_cases import COMPUTE_CASES, Case, Draw
from tests.compiler.op_fuzz_check_cases import CHECK_CASES
from tests.compiler.op_fuzz_view_cases import VIEW_CASES

CASES = {**COMPUTE_CASES, **VIEW_CASES, **CHECK_CASES}
WAYS = (2, 3)
BLOCKS = 2
"""Also split 2 ways in this many strided blocks (NodePlan.blocks, as the tp policy does for fused q/k/v)."""
DRAWS = 2
"""Seeded draws of every op's cases (other sizes each time)."""
SEED = 1234
TOLERANCE = {torch.float64: (1e-9, 1e-10), torch.float32: (1e-5, 1e-6)}


def builtin_ops() -> list[str]:
    """Ops whose rule comes from nnscaler.graph.ops (user ops registered by other tests are left out)."""
    return sorted(
        op
        for op, r in all_rules().items()
        if r.annotate.__module__.startswith("nnscaler.graph.ops.")
        and r.annotate.__module__ != "nnscaler.graph.ops.custom"
    )


# ---- ranks in one process -----------------------------------------------------------------------------


class _NeedsPeers(Exception):
    """A collective in a run with the ranks one after the other: run them as threads instead."""


class _World:
    def __init__(self, size: int, threaded: bool):
        self.size, self.threaded = size, threaded
        self.barrier = threading.Barrier(size, timeout=10)
        self.slots: list[torch.Tensor | None] = [None] * size


class _SimGroup:
    def __init__(self, rank: int, world: _World):
        self.rank, self.world = rank, world


class _SimDist:
    """The torch.distributed calls nnscaler.runtime.comm makes, over ranks that are threads."""

    ReduceOp = dist.ReduceOp

    @staticmethod
    def get_rank(group: _SimGroup) -> int:
        return group.rank

    @staticmethod
    def get_world_size(group: _SimGroup) -> int:
        return group.world.size

    @staticmethod
    def _exchange(group: _SimGroup, tensor: torch.Tensor) -> list[torch.Tensor]:
        world = group.world
        if not world.threaded:
            raise _NeedsPeers
        world.slots[group.rank] = tensor.clone()
        world.barrier.wait()
        got = list(world.slots)
        world.barrier.wait()
        return got

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, **_):
        got = self._exchange(group, tensor)
        if op == dist.ReduceOp.SUM:
            tensor.copy_(torch.stack(got).sum(0))
        elif op == dist.ReduceOp.MAX:
            tensor.copy_(torch.stack(got).amax(0))
        else:
            raise NotImplementedError(f"_SimDist.all_reduce: {op}")

    def all_gather_into_tensor(self, out, tensor, group=None, **_):
        out.copy_(torch.cat(self._exchange(group, tensor)))

    def reduce_scatter_tensor(self, out, tensor, group=None, **_):
        out.copy_(torch.stack(self._exchange(group, tensor)).sum(0).chunk(group.world.size)[group.rank])

    def all_to_all_single(self, out, tensor, group=None, **_):
        got = self._exchange(group, tensor)
        out.copy_(torch.cat([g.chunk(group.world.size)[group.rank] for g in got]))


_POOL = ThreadPoolExecutor(max_workers=max(WAYS))


def _callable(kind: str, op: str):
    if kind == "op":
        ns, name, overload = op.split(".")
        return getattr(getattr(getattr(torch.ops, ns), name), overload)
    if kind in ("comm", "special"):
        module, _, fn = op.rpartition(".")
        return getattr({"": comm, "rng": rng}[module], fn)
    if kind == "scale":
        return lambda x, n: x / n
    if kind == "bias":
        return lambda x, b: x + b
    raise ValueError(f"unknown statement kind {kind!r}")


def _run_rank(program, inputs: dict[str, torch.Tensor], group: _SimGroup) -> dict[str, object]:
    """One rank's local code for the node (the graph outputs' conversions, node None, are left out: the
    test merges the node's outputs itself)."""
    env: dict[str, object] = {k: v.clone() for k, v in inputs.items()}

    def val(a):
        if isinstance(a, Ref):
            return env[a.name]
        if a is GROUP:
            return group
        if isinstance(a, RankScaled):
            assert a.axis is None, "1-D splits only"
            return group.rank * a.scale
        if isinstance(a, (list, tuple)):
            return type(a)(val(x) for x in a)
        if isinstance(a, dict):
            return {k: val(x) for k, x in a.items()}
        return a

    for s in program.statements:
        if s.node is None:
            continue
        assert not s.shard_rng, "random ops under the shard generator need a real process group"
        with torch.no_grad() if s.no_grad else nullcontext():
            out = _callable(s.kind, s.op)(*val(s.args), **val(s.kwargs))
        if s.tuple_output or len(s.outputs) > 1:
            env.update(zip(s.outputs, out))
        else:
            env[s.outputs[0]] = out
    return env


def _run_ranks(program, inputs: dict[str, torch.Tensor], ways: int) -> list[dict[str, object]]:
    """Every rank's values: one after the other (each from the same seed, as replicated random ops
    expect), or as threads when some statement communicates."""
    world = _World(ways, threaded=False)
    try:
        envs = []
        for r in range(ways):
            torch.default_generator.manual_seed(SEED)
            envs.append(_run_rank(program, inputs, _SimGroup(r, world)))
        return envs
    except _NeedsPeers:
        pass
    world = _World(ways, threaded=True)

    def task(r: int):
        try:
            return _run_rank(program, inputs, _SimGroup(r, world))
        except BaseException:
            world.barrier.abort()
            raise

    futures = [_POOL.submit(task, r) for r in range(ways)]
    errors = [f.exception() for f in futures]
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real or any(errors):
        raise (real or errors)[0]
    return [f.result() for f in futures]


# ---- one op -------------------------------------------------------------------------------------------


def _dtype_name(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _clone(obj):
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_clone(x) for x in obj)
    if isinstance(obj, dict):
        return {k: _clone(v) for k, v in obj.items()}
    return obj


def _one_node_graph(op: str, case: Case) -> tuple[Graph, dict[str, torch.Tensor], list[torch.Tensor]]:
    """A graph of one node calling `op` on the case's inputs, the inputs by name, the whole op's outputs."""
    graph = GraphBuilder()
    inputs: dict[str, torch.Tensor] = {}
    names: dict[int, str] = {}  # a tensor passed twice is one value read twice

    def to_ref(obj):
        if isinstance(obj, torch.Tensor) and id(obj) in names:
            return Ref(names[id(obj)])
        if isinstance(obj, torch.Tensor):
            name = names[id(obj)] = f"in{len(inputs)}"
            inputs[name] = obj
            graph.values[name] = Value(name, TensorMeta(tuple(obj.shape), _dtype_name(obj)), "input")
            graph.inputs.append(name)
            return Ref(name)
        if isinstance(obj, (list, tuple)):
            return type(obj)(to_ref(x) for x in obj)
        return obj

    args = to_ref(case.args)
    kwargs = {k: to_ref(v) for k, v in case.kwargs.items()}
    torch.default_generator.manual_seed(SEED)
    whole = _callable("op", op)(*_clone(case.args), **_clone(case.kwargs))
    tuple_output = isinstance(whole, (tuple, list))
    outs = list(whole) if tuple_output else [whole]
    out_names = [f"out{i}" for i in range(len(outs))] if tuple_output else ["out"]
    for name, t in zip(out_names, outs):
        graph.values[name] = Value(name, TensorMeta(tuple(t.shape), _dtype_name(t)), producer="node")
    graph.nodes.append(Node("node", op, args, kwargs, out_names, tuple_output=tuple_output))
    graph.forward_args = list(graph.inputs)
    graph.outputs = [Ref(n) for n in out_names]
    return graph.build(), inputs, outs


def _merge(pieces: list, layout, full: torch.Tensor, check: str) -> torch.Tensor:
    if isinstance(layout, Replicate):
        for r, p in enumerate(pieces[1:], 1):
            _compare(p, pieces[0], f"rank {r} differs from rank 0 on a replicated output", check)
        return pieces[0]
    if isinstance(layout, Partial):
        return torch.stack(pieces).sum(0)
    if isinstance(layout, Shard):
        return assemble_shards(dict(enumerate(pieces)), full.shape, layout.dim, len(pieces), layout.blocks)
    raise AssertionError(f"unexpected layout {layout}")


def _compare(got, want: torch.Tensor, what: str, check: str = "value") -> None:
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}, not a tensor"
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert got.dtype == want.dtype, f"{what}: dtype {got.dtype}, expected {want.dtype}"
    if check == "value":
        rtol, atol = TOLERANCE.get(want.dtype, (0, 0))
        torch.testing.assert_close(
            got, want, rtol=rtol, atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}"
        )


def _check_dropout(got: torch.Tensor, x: torch.Tensor, p: float) -> None:
    """Sharded dropout draws other masks than the whole op: check it is a dropout of x."""
    kept = got != 0
    torch.testing.assert_close(got[kept], x[kept] / (1 - p), rtol=1e-12, atol=0)
    assert 0.2 < kept.double().mean().item() < 0.8, f"kept fraction {kept.double().mean().item():.2f}"


def _check_split(op, case, graph, inputs, whole, bound, ident, ways, blocks) -> str | None:
    """Run the node split `ways` ways (in `blocks` blocks) on `ident`; None when it matches the whole
    op, else why not."""
    layouts = layouts_for(bound, get_rule(op), ident, ways, blocks)
    try:
        nodes = {"node": NodePlan(split=ident, ways=ways, blocks=blocks)} if ident else {}
        program = apply_plan(graph, Plan("fuzz", ways, nodes))
        envs = _run_ranks(program, inputs, ways)
        for i, (name, want) in enumerate(zip(graph.nodes[0].outputs, whole)):
            layout = program.layouts[name]
            what = f"output {i} ({layout})"
            merged = _merge([env[name] for env in envs], layout, want, case.check)
            if case.check == "dropout":
                _compare(merged, want, what, "meta")
                _check_dropout(merged, inputs["in0"], case.args[1])
            else:
                _compare(merged, want, what, case.check)
    except Exception as exc:  # noqa: BLE001  (every failure is reported with the split that made it)
        where = "replicated" if ident is None else f"split {ident!r} {ways} ways"
        where += f" x{blocks} blocks" if blocks > 1 else ""
        lay = "" if isinstance(layouts, str) else f"inputs {layouts.inputs} -> outputs {layouts.outputs}; "
        return f"{where}: {lay}annotation '{bound}': {type(exc).__name__}: {exc}"
    return None


def _describe(case: Case) -> str:
    """The case's arguments, tensors as dtype[shape]."""

    def show(a):
        if isinstance(a, torch.Tensor):
            return f"{_dtype_name(a)}{list(a.shape)}"
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(show(x) for x in a) + "]"
        return repr(a)

    return ", ".join([show(a) for a in case.args] + [f"{k}={show(v)}" for k, v in case.kwargs.items()])


def _splits(bound, rule) -> list[tuple[str | None, int, int]]:
    """(identifier, ways, blocks) of every split the rule allows; a replicated run when there is none."""
    out = [(ident, ways, 1) for ways in WAYS for ident in split_candidates(bound, ways)]
    out += [
        (ident, 2, BLOCKS)
        for ident in split_candidates(bound, 2)
        if not isinstance(layouts_for(bound, rule, ident, 2, BLOCKS), str)
    ]
    return out or [(None, 2, 1)]


def _fuzz(op: str) -> list[str]:
    """Failures of every case of `op` (empty when the rule holds)."""
    maker = CASES.get(op)
    if maker is None:
        return [
            f"no fuzz case: add a maker for {op!r} to tests/compiler/op_fuzz_cases.py or op_fuzz_view_cases.py"
        ]
    failures = []
    for draw in range(DRAWS):
        for k, case in enumerate(maker(Draw(zlib.crc32(op.encode()) + draw))):
            what = f"draw {draw} case {k} ({_describe(case)})"
            try:
                graph, inputs, whole = _one_node_graph(op, case)
                bound = annotate_node(graph.nodes[0], graph)
            except Exception as exc:  # noqa: BLE001
                failures.append(f"{what}: {type(exc).__name__}: {exc}")
                continue
            for ident, ways, blocks in _splits(bound, get_rule(op)):
                problem = _check_split(op, case, graph, inputs, whole, bound, ident, ways, blocks)
                if problem:
                    failures.append(f"{what}, {problem}")
    return failures


@pytest.fixture
def sim_dist(monkeypatch):
    """Ranks in this process; the default generator and thread count as they were afterwards (one
    intra-op thread: the tensors are tiny, and idle OpenMP workers cost more than they give)."""
    monkeypatch.setattr(comm, "dist", _SimDist())
    monkeypatch.setattr(chunked_loss, "dist", comm.dist)  # its vocab-parallel kernel's collectives
    monkeypatch.setattr(rng, "_GENERATORS", {})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("op", builtin_ops())
def test_rule_holds(op, sim_dist):
    failures = _fuzz(op)
    assert not failures, f"{op}: the rule's splits do not compute the op:\n  " + "\n  ".join(failures)


def test_cases_are_registered_ops():
    stale = sorted(set(CASES) - set(all_rules()))
    assert not stale, f"op_fuzz_cases.py / op_fuzz_view_cases.py have cases for ops without a rule: {stale}"


def test_random_creation_ops_are_replicate_only(sim_dist):
    """rand / randn draw the whole tensor from one stream: a piece per rank would draw other numbers, so
    the rule must allow no split (dropout may split: partition draws each shard's mask from its own
    generator, and the fuzz checks it is a dropout of the input)."""
    for op in ["aten.rand.default", "aten.randn.default"]:
        graph, _, _ = _one_node_graph(op, Case(([6, 12],)))
        bound = annotate_node(graph.nodes[0], graph)
        assert all(not split_candidates(bound, w) for w in WAYS), f"{op} '{bound}' allows a split"


def test_specials_refuse_strided_blocks(sim_dist):
    """The vocab-parallel helpers take this rank's contiguous range of rows / classes: a strided split
    (blocks > 1) of their identifier would look rows up in the wrong places, so it is refused."""
    for op, case, ident in [
        ("aten.embedding.default", Case((torch.randn(12, 4), torch.randint(0, 12, (5,)))), "v"),
        ("aten.cross_entropy_loss.default", Case((torch.randn(6, 12), torch.randint(0, 12, (6,)))), "c"),
    ]:
        graph, _, _ = _one_node_graph(op, case)
        bound = annotate_node(graph.nodes[0], graph)
        assert not isinstance(layouts_for(bound, get_rule(op), ident, 2), str)
        assert "blocks must be 1" in layouts_for(bound, get_rule(op), ident, 2, BLOCKS)
