"""Measured op costs (optional): time each op of a graph on this machine's device, at the local shapes
of its candidate splits, into a small JSON database; the cost model uses a measured time where it has
one and the analytic roofline elsewhere (pas_config['profile_db_path']).

    db = profile_graph(graph, ways=(1, 2))      # or profile_module(model, dummy_inputs, ways=(1, 2))
    db.save("ops_cpu.json")

`python -m nnscaler.profiler` (nnscaler.cli.profile) does the same for a model builder from the command line.

Ops whose local code is not the op on local shards (views with shape arguments, specials) and ops
that fail to run on random inputs are left to the analytic model.

`profile_link()`, called on every rank of a live process group, times chains of all-reduces of
several sizes (as a step meets them) and fits the alpha-beta link of the cost model
(comm.ring_all_reduce) to them; stored in the database (`db.links['intra_node']`), it replaces the cluster file's figure for that link.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from nnscaler.graph.capture import capture
from nnscaler.graph.ir import Graph, Node, Ref, map_refs
from nnscaler.graph.ops import annotate_node, get_rule, layouts_for, mesh_layouts_for
from nnscaler.policies.autodist.choices import _local_shapes, _plans, op_key, tensor_refs
from nnscaler.policies.autodist.cluster import LinkSpec
from nnscaler.policies.autodist.cost import is_free_op

__all__ = [
    "ProfileDB",
    "op_key",
    "local_shapes",
    "profile_graph",
    "profile_module",
    "profile_link",
    "fit_link",
]


@dataclass
class ProfileDB:
    """Seconds of forward + backward per op key, measured on `device`; measured links by cluster
    field name ('intra_node' / 'inter_node': {bandwidth_gbs, latency_us})."""

    device: str = "cpu"
    entries: dict[str, float] = field(default_factory=dict)
    links: dict[str, dict[str, float]] = field(default_factory=dict)
    step_overhead_s: float = 0.0
    """What timing one op alone costs besides the op (starting a backward pass, the loss): measured
    once, taken out of every entry, and charged once per micro-batch instead."""
    free_op_s: float = 0.0
    """Forward + backward seconds of an op that moves no data (a view, a transpose): no kernel, but
    the framework's dispatch and autograd bookkeeping, charged to every such op (0: not measured)."""

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        data = {
            "device": self.device,
            "entries": self.entries,
            "links": self.links,
            "step_overhead_s": self.step_overhead_s,
            "free_op_s": self.free_op_s,
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
        tmp.replace(path)  # readers never see half a database
        return path

    @classmethod
    def merged(cls, dbs: list[ProfileDB], how: str = "median") -> ProfileDB:
        """One database from several profiles of one kind of device (several ranks profiling at
        once, or one device at several times): each entry, link figure and overhead is the median
        (`how='median'`) or the largest (`how='max'`: the slowest rank's pace, for machines whose
        cores differ steadily) of the databases that have it."""
        if how not in ("median", "max"):
            raise ValueError(f"ProfileDB.merged(how={how!r}): use 'median' or 'max'")
        if not dbs:
            raise ValueError("ProfileDB.merged needs at least one database")
        devices = {db.device for db in dbs}
        if len(devices) > 1:
            raise ValueError(f"ProfileDB.merged over databases of different devices {sorted(devices)}")
        pick = statistics.median if how == "median" else max

        def of(values: list[float]) -> float:
            return pick(values) if values else 0.0

        keys = sorted({k for db in dbs for k in db.entries})
        entries = {k: of([db.entries[k] for db in dbs if k in db.entries]) for k in keys}
        links: dict[str, dict[str, float]] = {}
        for name in sorted({n for db in dbs for n in db.links}):
            specs = [db.links[name] for db in dbs if name in db.links]
            fields = sorted({f for spec in specs for f in spec})
            links[name] = {f: of([spec[f] for spec in specs if f in spec]) for f in fields}
        return cls(
            dbs[0].device,
            entries,
            links,
            of([db.step_overhead_s for db in dbs if db.step_overhead_s]),
            of([db.free_op_s for db in dbs if db.free_op_s]),
        )

    @classmethod
    def load(cls, path: str | Path) -> ProfileDB:
        data = json.loads(Path(path).read_text())
        links = {k: {f: float(x) for f, x in v.items()} for k, v in data.get("links", {}).items()}
        entries = {k: float(v) for k, v in data["entries"].items()}
        return cls(
            data.get("device", "cpu"),
            entries,
            links,
            float(data.get("step_overhead_s", 0.0)),
            float(data.get("free_op_s", 0.0)),
        )


def local_shapes(
    graph: Graph, refs: list[str], layouts, ways: int, mesh: tuple[int, ...] = ()
) -> list[tuple[int, ...]]:
    """Shapes one device sees of each tensor input under `layouts` (MeshLayouts over `mesh`)."""
    return _local_shapes(graph, refs, layouts, ways, mesh)


def _tensor(meta, shape, device: torch.device):
    dtype = getattr(torch, meta.dtype.replace("torch.", ""))
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype, device=device).requires_grad_(meta.requires_grad)
    return torch.zeros(shape, dtype=dtype, device=device)


def _sync(device: torch.device) -> None:
    """Wait for the device's queued kernels, so that a host clock times them (CUDA runs ahead)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_once(fn, args, kwargs, grads: list[torch.Tensor], repeats: int, device: torch.device) -> float:
    samples = []
    for _ in range(repeats + 1):
        _sync(device)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        outs = [o for o in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(o, torch.Tensor)]
        loss = sum(o.float().sum() for o in outs if o.requires_grad)
        if grads and isinstance(loss, torch.Tensor):
            loss.backward()
        _sync(device)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples[1:])


_FLOOR_S = 1e-6
"""Least time an entry keeps once the harness overhead is taken out (timing noise can exceed the op)."""


_CHAIN = 9
"""Ops in the longer chain of the overhead measurement (the shorter has one)."""


def _per_op_and_rest(op, repeats: int, device: torch.device) -> tuple[float, float]:
    """Seconds of one `op` (forward + backward) on a one-element tensor, and what the timing harness
    costs around it, from chains of 1 and _CHAIN ops: the harness is the part a longer chain does
    not add to (best of 3, as the harness is a floor)."""
    x = torch.ones(1, device=device, requires_grad=True)

    def chain(k: int):
        def fn(t):
            for _ in range(k):
                t = op(t)
            return t

        return fn

    one, many = (
        min(_time_once(chain(k), (x,), {}, [x], repeats * 3, device) for _ in range(3)) for k in (1, _CHAIN)
    )
    per_op = max((many - one) / (_CHAIN - 1), 0.0)
    return per_op, max(one - per_op, 0.0)


def _harness_overhead(repeats: int, device: torch.device) -> float:
    """Seconds the timing harness adds around an op (the forward call, the loss, starting the backward
    pass). On a CPU, where the host runs the ops, without the op's own: a cheap op's dispatch is a
    real part of what every entry measures (taken out with the harness, it left each of a tiny model's
    ops short by that dispatch). On an asynchronous device (CUDA) the host's dispatch of an op
    overlaps the kernels queued before it, so the device's time is the measure: the harness is taken
    out with the cheap op's dispatch, as before."""
    per_op, rest = _per_op_and_rest(lambda t: t * 1.0, repeats, device)
    return rest if device.type == "cpu" else rest + per_op


def _free_op_time(repeats: int, device: torch.device) -> float:
    """Forward + backward seconds of a view: what an op that moves no data still costs where the host
    runs the ops (a CPU); 0 on an asynchronous device, where it launches no kernel."""
    if device.type != "cpu":
        return 0.0
    return _per_op_and_rest(lambda t: t.view(-1), repeats, device)[0]


def _measure(
    graph: Graph, node: Node, shapes: list[tuple[int, ...]], repeats: int, device: torch.device
) -> float | None:
    parts = node.op.split(".")
    try:
        fn = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, IndexError):
        return None
    refs = tensor_refs(graph, node)
    tensors = {r: _tensor(graph.values[r].meta, s, device) for r, s in zip(refs, shapes)}

    def value(ref: Ref):
        return tensors.get(ref.name)

    try:
        args = map_refs(node.args, value)
        kwargs = map_refs(node.kwargs, value)
        grads = [t for t in tensors.values() if t.requires_grad]
        return _time_once(fn, args, kwargs, grads, repeats, device)
    except torch.OutOfMemoryError:  # a shape too big for this device: analytic model, memory given back
        tensors.clear()
        torch.cuda.empty_cache()
        return None
    except Exception:  # shapes or arguments this op does not take at local sizes: analytic model
        return None


def profile_graph(
    graph: Graph,
    ways: tuple[int, ...] = (1,),
    repeats: int = 3,
    db: ProfileDB | None = None,
    device: str | torch.device | None = None,
) -> ProfileDB:
    """Measure every op of `graph` at the local shapes of each candidate split over each of `ways`
    (2-D splits too, over the [2, w / 2] mesh autodist offers for an even w of 4 or more), on `device` (default: the current CUDA device where there is one, else the CPU; a given `db`
    keeps its own device)."""
    if device is None:
        device = db.device if db is not None else ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    db = db or ProfileDB(device.type)
    if db.device != device.type:
        raise ValueError(
            f"profile_graph(device={str(device)!r}) into a database of {db.device!r} timings: "
            "one database holds one kind of device (start a new ProfileDB)"
        )
    if not db.step_overhead_s:
        db.step_overhead_s = _harness_overhead(repeats, device)
    if not db.free_op_s:
        db.free_op_s = _free_op_time(repeats, device)
    for node in graph.nodes:
        rule = get_rule(node.op)
        bound = annotate_node(node, graph)
        if rule is None or bound is None or rule.shape_args or is_free_op(node, graph):
            continue
        refs = tensor_refs(graph, node)
        out_meta = next((graph.values[o].meta for o in node.outputs if graph.values[o].meta), None)
        if out_meta is None:
            continue
        for w in ways:
            mesh = (2, w // 2) if w >= 4 and w % 2 == 0 else ()  # the mesh tp_mesh 'auto' offers
            for plan in _plans(graph, node, bound, w, mesh):
                idents = [i for i, _ in plan.mesh_splits] if plan.mesh_splits else [plan.split]
                if any(i is not None and rule.specials.get(i) is not None for i in idents):
                    continue
                if plan.mesh_splits:
                    lay = mesh_layouts_for(bound, rule, plan.mesh_splits, mesh)
                    blocked = any(b > 1 for _, b in plan.mesh_splits)
                else:
                    lay = layouts_for(bound, rule, plan.split, plan.ways if plan.split else 1, plan.blocks)
                    blocked = plan.blocks > 1
                if isinstance(lay, str) or blocked:
                    continue
                plan_ways = w if plan.mesh_splits else (plan.ways if plan.split else 1)
                shapes = local_shapes(graph, refs, lay.inputs, plan_ways, mesh)
                key = op_key(node.op, shapes, out_meta.dtype)
                if key in db.entries:
                    continue
                t = _measure(graph, node, shapes, repeats, device)
                if t is not None:
                    db.entries[key] = max(t - db.step_overhead_s, _FLOOR_S)
    return db


def profile_module(
    module: torch.nn.Module,
    dummy_forward_args: dict[str, Any],
    ways: tuple[int, ...] = (1,),
    repeats: int = 5,
    device: str | torch.device | None = None,
    db: ProfileDB | None = None,
) -> ProfileDB:
    """Trace `module(**dummy_forward_args)` (its own train/eval mode) and time every op at the local
    shapes of its candidate splits over each of `ways` devices, on `device` (default: CUDA where
    there is one, else the CPU). The module's weights are not used: ops run on random inputs."""
    graph = capture(module, dummy_forward_args, both_modes=False)
    return profile_graph(graph, ways=ways, repeats=repeats, db=db, device=device)


def fit_link(samples: list[tuple[float, float]], p: int) -> LinkSpec:
    """The LinkSpec whose ring all-reduce time best fits (bytes, seconds) samples over `p` devices
    (least squares on t = 2(p-1) alpha + 2(p-1)/p bytes / beta)."""
    if p < 2 or len(samples) < 2:
        raise ValueError("fit_link needs p >= 2 and at least two (bytes, seconds) samples")
    xs = [2 * (p - 1) / p * n for n, _ in samples]
    ys = [t for _, t in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    slope = max(slope, 1e-15)  # seconds per byte; a flat fit means a link faster than we can see
    alpha = max((my - slope * mx) / (2 * (p - 1)), 0.0)
    return LinkSpec(bandwidth_gbs=1.0 / slope / 1e9, latency_us=alpha * 1e6)


def profile_link(
    group=None,
    sizes: tuple[int, ...] = (1 << 10, 1 << 14, 1 << 17, 1 << 20, 1 << 22),
    repeats: int = 10,
    rounds: int = 3,
) -> LinkSpec:
    """Fit this group's link from timed all-reduces of float32 buffers of `sizes` bytes. Collective:
    every rank of `group` calls it; all get the same figures (rank 0's timings, broadcast).

    The all-reduces are timed as a step meets them: one after another, each after a little compute
    (whose own time is taken off), not each from a barrier. On gloo over a shared CPU machine such
    chains cost several times what barrier-started all-reduces do (the ranks drift apart and each
    collective waits for the later one and wakes its threads up), and the steps are made of chains.
    """
    import torch.distributed as dist

    p = dist.get_world_size(group)
    spacer = torch.randn(64, 64)

    def work() -> None:
        for _ in range(4):
            spacer @ spacer

    samples = []
    for nbytes in sizes:
        buf = torch.zeros(max(nbytes // 4, 1))
        dist.all_reduce(buf, group=group)  # warm the connection up
        per_round = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(repeats):
                work()
            compute = time.perf_counter() - t0
            dist.barrier(group=group)
            t0 = time.perf_counter()
            for _ in range(repeats):
                work()
                dist.all_reduce(buf, group=group)
            per_round.append(max(time.perf_counter() - t0 - compute, 0.0) / repeats)
        samples.append((float(nbytes), statistics.median(per_round)))
    shared = [samples]
    dist.broadcast_object_list(shared, src=dist.get_global_rank(group, 0) if group else 0, group=group)
    return fit_link(shared[0], p)
