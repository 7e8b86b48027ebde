"""nnScaler 0.8's IRGraph policy primitives (select, partition, replicate, assign, staging, recompute,
sched) over our traced Graph. The Graph is never changed: each call is checked and recorded in a
PolicyRecord (plain data); nnscaler.policies.policy_api08 turns the record into a Plan."""

from __future__ import annotations

import bisect
from typing import Any

from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph
from nnscaler.graph.ops import get_rule
from nnscaler.graph.policy_api.cells import (
    DimAlgorithm,
    IRCell,
    IRDimops,
    IRFullTensor,
    IRFwOperation,
    IRSubTensor,
    flatten_types,
)
from nnscaler.graph.policy_api.record import NodeFate, PolicyRecord, ScheduleRecord

__all__ = ["IRSegment", "IRGraph"]


class IRSegment(IRCell):
    """A pipeline stage made by graph.staging (nnScaler's forward segment)."""

    def __init__(self, owner: IRGraph | None, stage: int) -> None:
        self._owner = owner
        self.stage = stage
        self.name = f"segment{stage}"
        self.cid = -1 - stage
        self.device: tuple[int, ...] = ()

    def nodes(self, flatten: bool = False) -> list[IRCell]:
        """The stage's operations (the pieces of transformed ones) in graph order."""
        return [n for n in self._owner._order if self._owner.stage_of(n) == self.stage]

    def node(self, index: int) -> IRCell:
        return self.nodes()[index]

    def select(self, name: str | None = None, ntype: Any = None, flatten: bool = True) -> list[IRCell]:
        """Nodes whose name is `name` (if given) and whose type is `ntype` (if given)."""
        types = flatten_types(ntype)
        return [
            n
            for n in self.nodes()
            if (name is None or n.name == name) and (types is None or isinstance(n, types))
        ]

    def __repr__(self) -> str:
        return f"IRSegment(stage {self.stage}, {len(self.nodes())} nodes)"


class IRGraph(IRSegment):
    """The policy's view of the traced graph; `record` holds what the policy decided."""

    def __init__(self, graph: Graph, plan_ngpus: int) -> None:
        super().__init__(self, -1)
        self.name = "graph"
        self.traced = graph
        self.plan_ngpus = plan_ngpus
        self.record = PolicyRecord()
        self._index = {n.name: i for i, n in enumerate(graph.nodes)}
        self._tensors: dict[str, IRFullTensor] = {}
        self._next_cid = len(graph.nodes)
        self._order: list[IRFwOperation] = [self._op(n, i) for i, n in enumerate(graph.nodes)]
        self._starts: list[int] | None = None
        self._segments: list[IRSegment] = []
        self._sched: ScheduleRecord | None = None

    def _op(self, node, cid: int, piece: int = 0, pieces: int = 1) -> IRFwOperation:
        cls = IRDimops if get_rule(node.op) is not None else IRFwOperation
        return cls(node, self, cid, piece, pieces)

    # ---- tensors -------------------------------------------------------------------------------
    def full_tensor(self, name: str) -> IRFullTensor:
        if name not in self._tensors:
            self._tensors[name] = IRFullTensor(name, self.traced)
        return self._tensors[name]

    def sub_tensor(self, name: str) -> IRSubTensor:
        return IRSubTensor(name, self.traced, self.full_tensor(name))

    def full_tensors(self) -> list[IRFullTensor]:
        return [self.full_tensor(n) for n, v in self.traced.values.items() if v.meta is not None]

    def inputs(self) -> tuple[IRSubTensor, ...]:
        return tuple(self.sub_tensor(n) for n in self.traced.inputs if self.traced.values[n].meta)

    def outputs(self) -> tuple[IRSubTensor, ...]:
        names = self.traced.output_names()
        return tuple(self.sub_tensor(n) for n in names if self.traced.values[n].meta)

    def attributes(self) -> tuple[IRFullTensor, ...]:
        return tuple(t for t in self.full_tensors() if t.is_attr())

    def consumers(self, ftensor: IRFullTensor) -> list[IRFwOperation]:
        return [n for n in self._order if ftensor.name in n._tensor_names()]

    def producers(self, ftensor: IRFullTensor) -> list[IRFwOperation]:
        return [n for n in self._order if ftensor.name in n._node.outputs]

    def multiref(self, ftensor: IRFullTensor, *args: Any, **kwargs: Any) -> None:
        """No-op: the partitioner converts between every producer's and consumer's layout itself."""
        return None

    # ---- selection ---------------------------------------------------------------------------
    def nodes(self, flatten: bool = False) -> list[IRCell]:
        """Top-level cells: the stages after graph.staging (all ops with flatten=True), else the ops."""
        if self._segments and not flatten:
            return list(self._segments)
        return list(self._order)

    def select(self, name: str | None = None, ntype: Any = None, flatten: bool = True) -> list[IRCell]:
        types = flatten_types(ntype)
        out: list[IRCell] = []
        for cell in self.nodes():
            if (name is None or cell.name == name) and (types is None or isinstance(cell, types)):
                out.append(cell)
            if flatten and isinstance(cell, IRSegment):
                out += cell.select(name, ntype, flatten)
        return out

    def exist(self, node: IRCell) -> bool:
        return node in self._order or node in self._segments

    def segment(self, node: IRCell) -> IRSegment:
        """The stage holding `node` (the graph itself before staging)."""
        return self._segments[self.stage_of(node)] if self._segments else self

    def stage_of(self, node: IRFwOperation) -> int:
        if self._starts is None:
            return 0
        return bisect.bisect_right(self._starts, self._index[node.origin]) - 1

    # ---- transformation primitives ----------------------------------------------------------------
    def _check_transformable(self, node: Any, call: str) -> None:
        if not isinstance(node, IRFwOperation) or node not in self._order:
            raise PlanError(f"{call}: {node!r} is not a forward operation of this graph")
        fate = self.record.fates.get(node.origin)
        if fate is not None and fate.kind != "whole":
            raise PlanError(
                f"{call}: {node.origin} was already transformed by {fate.call}; a Plan splits each "
                "traced op once (nested partition/replicate cannot be expressed)"
            )

    def _replace(self, node: IRFwOperation, fate: NodeFate) -> list[IRFwOperation]:
        pieces = []
        for k in range(fate.num):
            piece = self._op(node._node, self._next_cid, k, fate.num)
            piece.is_piece = True
            piece.comment = node.comment
            self._next_cid += 1
            pieces.append(piece)
        at = self._order.index(node)
        self._order[at : at + 1] = pieces
        self.record.fates[node.origin] = fate
        return pieces

    def partition(self, node: IRFwOperation, algo: DimAlgorithm, **config: Any) -> list[IRFwOperation]:
        """Split `node` into config['num'] pieces on input config['idx']'s dim config['dim']."""
        idx, dim, num = config.get("idx"), config.get("dim"), config.get("num")
        call = f"graph.partition({getattr(node, 'origin', node)}, idx={idx}, dim={dim}, num={num})"
        self._check_transformable(node, call)
        if not isinstance(algo, DimAlgorithm) or algo.node is not node:
            raise PlanError(f"{call}: give node.algorithm('dim') of this node")
        extra = sorted(set(config) - {"idx", "dim", "num"})
        if extra:
            raise PlanError(f"{call}: unknown options {extra}; algorithm('dim') takes idx, dim and num")
        why = algo.why_not(idx, dim, num)
        if why is not None:
            raise ValueError(f"Fail to partition node {node.origin} ({node.name}) with {call}: {why}")
        fate = NodeFate("partition", [None] * num, call, algo.identifier(idx, dim), idx, dim)
        return self._replace(node, fate)

    def replicate(self, node: IRFwOperation, times: int = 1) -> list[IRFwOperation]:
        """`times` copies of `node`, each computing the whole op."""
        call = f"graph.replicate({getattr(node, 'origin', node)}, times={times})"
        if not isinstance(times, int) or times < 1:
            raise TypeError(f"{call}: times must be an int >= 1")
        self._check_transformable(node, call)
        return self._replace(node, NodeFate("replicate", [None] * times, call))

    def assign(self, node: IRCell, device: int) -> bool:
        """Place an op (a piece, or every op of a stage) on plan device `device`."""
        call = f"graph.assign({getattr(node, 'origin', node)}, {device})"
        if not isinstance(device, int) or not 0 <= device < self.plan_ngpus:
            raise PlanError(f"{call}: device must be one of the plan devices 0..{self.plan_ngpus - 1}")
        if isinstance(node, IRSegment):
            for sub in node.nodes():
                self.assign(sub, device)
            return True
        if not isinstance(node, IRFwOperation) or node not in self._order:
            raise PlanError(f"{call}: {node!r} is not a forward operation of this graph")
        node._device = device
        if node.is_piece:
            self.record.fates[node.origin].devices[node.piece] = device
        else:
            self.record.fates[node.origin] = NodeFate("whole", [device], call)
        return True

    # ---- staging, recompute, schedule ------------------------------------------------------------
    def staging(self, nodes: Any) -> None:
        """Pipeline stages starting at `nodes` (the first stage also takes every op before it)."""
        nodes = list(nodes)
        call = f"graph.staging([{', '.join(str(getattr(n, 'origin', n)) for n in nodes)}])"
        if self._starts is not None:
            raise PlanError(f"{call}: the graph is already staged by {self.record.staging_call}")
        if any(f.kind != "whole" for f in self.record.fates.values()):
            raise PlanError(f"{call}: call graph.staging before any graph.partition / graph.replicate")
        for n in nodes:
            if not isinstance(n, IRFwOperation) or n not in self._order:
                raise PlanError(f"{call}: {n!r} is not a forward operation of this graph")
        starts = [self._index[n.origin] for n in nodes]
        if not starts or starts != sorted(set(starts)):
            raise PlanError(f"{call}: give the first op of each stage once, in graph order")
        starts[0] = 0
        self._starts = starts
        self._segments = [IRSegment(self, s) for s in range(len(starts))]
        self.record.stage_starts = [self.traced.nodes[i].name for i in starts]
        self.record.staging_call = call

    def recompute(self, nodes: Any) -> bool:
        """Recompute these ops' activations in backward (one group)."""
        ops = nodes.nodes() if isinstance(nodes, IRSegment) else list(nodes)
        call = f"graph.recompute([{', '.join(str(getattr(n, 'origin', n)) for n in ops)}])"
        for n in ops:
            if not isinstance(n, IRFwOperation):
                raise PlanError(f"{call}: {n!r} is not a forward operation")
        for n in ops:
            n.recompute = len(self.record.recompute_groups)
        self.record.recompute_groups.append((list(dict.fromkeys(n.origin for n in ops)), call))
        return True

    @property
    def sched(self) -> ScheduleRecord | None:
        """The bound pipeline schedule (cfg.apply_pipeline_scheduler / PredefinedSched), or None."""
        return self._sched

    def bind_pipeline_schedule(self, nstages: int, nmicros: int, scheduler: str, call: str) -> IRGraph:
        """Record the pipeline schedule (what ComputeConfig.apply_pipeline_scheduler calls)."""
        if self._sched is not None:
            raise PlanError(f"{call}: the graph is already bound to {self._sched.call}")
        self._sched = ScheduleRecord(nstages, nmicros, scheduler, call)
        self.record.schedule = self._sched
        return self

    def __getattr__(self, name: str) -> Any:
        if name in _NO_PLAN_EQUIVALENT:
            raise PlanError(
                f"graph.{name}(...): nnScaler 0.8's {name} has no equivalent in a Plan ({_NO_PLAN_EQUIVALENT[name]}); "
                "the front supports select, nodes, partition, replicate, assign, staging, recompute and sched"
            )
        raise AttributeError(f"'IRGraph' object has no attribute {name!r}")

    def __repr__(self) -> str:
        return f"IRGraph({len(self._order)} ops, plan_ngpus={self.plan_ngpus})"


_NO_PLAN_EQUIVALENT = {
    "fuse": "ops are split one by one; register a fused op with register_op instead",
    "sequential": "ops run in traced order",
    "depends": "ops run in traced order",
    "group": "stages come from graph.staging",
    "blocking": "stages come from graph.staging",
    "reside": "tensors live where the ops that use them run",
    "finsert": "the traced graph is not edited",
    "insert": "the traced graph is not edited",
    "remove": "the traced graph is not edited",
    "backward": "autograd derives backward",
    "_bind_schedule": "bind a schedule with cfg.apply_pipeline_scheduler or PredefinedSched",
}
