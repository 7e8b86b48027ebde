"""nnScaler 0.8's policy API (IRGraph primitives) records into a Plan: for each primitive, a 0.8-style
policy and the same choices written as a Plan give the same generated code, and the 0.8-style policy
trains like the single-device model (2 ranks, gloo, SGD: parameters compared)."""

from __future__ import annotations

from pathlib import Path

from nnscaler import ComputeConfig, parallelize
from nnscaler.graph import IRGraph
from nnscaler.graph.capture import capture
from nnscaler.graph.function.dimops import IRDimops
from nnscaler.graph.ir import Graph
from nnscaler.graph.schedule.predefined import PredefinedSched
from nnscaler.graph.segment import IRSegment
from nnscaler.ir.operator import IRDataOperation, IRFwOperation
from nnscaler.policies import REPLICATE, NodePlan, PipelinePlan, Plan
from tests import zoo
from tests.parity import ParityCase, run_parity_many

NMICROS = 2
E2E = {"use_end2end": True}


def _replicate_rest(graph: IRGraph, devs: list[int]) -> None:
    """swin's idiom: replicate every op not placed yet."""
    for node in graph.select(ntype=(IRFwOperation, IRDataOperation)):
        if len(node.device) == 0:
            for dev, sub in zip(devs, graph.replicate(node, times=len(devs))):
                graph.assign(sub, dev)


def _block_start(graph: IRGraph, block: str) -> IRFwOperation:
    return next(n for n in graph.select(ntype=IRFwOperation) if block in n.module_stack)


# ---- 0.8-style policies and the same choices as Plans ----------------------------------------------
def p08_partition(graph: IRGraph, cfg: ComputeConfig) -> IRGraph:
    """Every linear split on its weight's output dim (input 1, dim 0), piece k on device k."""
    devs = list(range(cfg.plan_ngpus))
    for node in graph.select(name="linear", ntype=IRFwOperation):
        subs = graph.partition(node, node.algorithm("dim"), idx=1, dim=0, num=len(devs))
        for dev, sub in zip(devs, subs):
            graph.assign(sub, dev)
    _replicate_rest(graph, devs)
    return graph


def plan_partition(graph: Graph, cfg: ComputeConfig) -> Plan:
    nodes = {
        n.name: NodePlan("n", cfg.plan_ngpus) if n.op == "aten.linear.default" else REPLICATE
        for n in graph.nodes
    }
    return Plan("p08_partition", cfg.plan_ngpus, nodes)


def p08_replicate(graph: IRGraph, cfg: ComputeConfig) -> IRGraph:
    devs = list(range(cfg.plan_ngpus))
    for node in graph.nodes():
        for dev, sub in zip(devs, graph.replicate(node, times=len(devs))):
            graph.assign(sub, dev)
    return graph


def plan_replicate(graph: Graph, cfg: ComputeConfig) -> Plan:
    return Plan("p08_replicate", cfg.plan_ngpus, {n.name: REPLICATE for n in graph.nodes})


def p08_recompute(graph: IRGraph, cfg: ComputeConfig) -> IRGraph:
    """Each transformer block's ops form one recompute group; linears split as in p08_partition."""
    for block in ("transformer.h.0", "transformer.h.1"):
        graph.recompute([n for n in graph.select(ntype=IRFwOperation) if block in n.module_stack])
    return p08_partition(graph, cfg)


def plan_recompute(graph: Graph, cfg: ComputeConfig) -> Plan:
    plan = plan_partition(graph, cfg)
    return Plan("p08_recompute", cfg.plan_ngpus, plan.nodes, recompute=("transformer.h.0", "transformer.h.1"))


def _stage_by_block(graph: IRGraph) -> list[IRSegment]:
    graph.staging([graph.select(ntype=IRFwOperation)[0], _block_start(graph, "transformer.h.1")])
    return [s for s in graph.select(ntype=IRSegment, flatten=False) if s.isfw()]


def p08_staging(graph: IRGraph, cfg: ComputeConfig) -> IRGraph:
    """Two stages (the second starts at block 1), stage s on device s, 1F1B via the ComputeConfig."""
    for idx, stage in enumerate(_stage_by_block(graph)):
        graph.assign(stage, idx)
    cfg.apply_pipeline_scheduler(graph, 2, NMICROS, "1f1b")
    return graph


def _block1_start(graph: Graph) -> str:
    return next(n.name for n in graph.nodes if n.module_path.startswith("transformer.h.1"))


def plan_staging(graph: Graph, cfg: ComputeConfig) -> Plan:
    pipeline = PipelinePlan((graph.nodes[0].name, _block1_start(graph)), 2, NMICROS, "1f1b")
    return Plan("p08_staging", cfg.plan_ngpus, {n.name: REPLICATE for n in graph.nodes}, pipeline=pipeline)


def p08_sched(graph: IRGraph, cfg: ComputeConfig) -> IRGraph:
    """The same stages, GPipe bound with PredefinedSched (readable back through graph.sched)."""
    for idx, stage in enumerate(_stage_by_block(graph)):
        for node in stage.nodes():
            graph.assign(node, idx)
    PredefinedSched.sched_gpipe(graph, NMICROS, 2)
    assert graph.sched.scheduler == "gpipe" and graph.sched.nmicros == NMICROS
    return graph


def plan_sched(graph: Graph, cfg: ComputeConfig) -> Plan:
    pipeline = PipelinePlan((graph.nodes[0].name, _block1_start(graph)), 2, NMICROS, "gpipe")
    return Plan("p08_sched", cfg.plan_ngpus, {n.name: REPLICATE for n in graph.nodes}, pipeline=pipeline)


CASES = {
    # primitive: (model, 0.8-style policy, the same Plan, ComputeConfig kwargs)
    "partition": ("mlp", p08_partition, plan_partition, {}),
    "replicate": ("mlp", p08_replicate, plan_replicate, {}),
    "recompute": ("gpt", p08_recompute, plan_recompute, {}),
    "staging": ("gpt", p08_staging, plan_staging, E2E),
    "sched": ("gpt", p08_sched, plan_sched, E2E),
}


def _gencode_files(save: Path) -> dict[str, list[str]]:
    """The generated files without the header line naming the policy function."""
    files = sorted(save.rglob("gencode*.py"))
    assert len(files) == 2, files
    return {f.name: [ln for ln in f.read_text().splitlines() if "policy:" not in ln] for f in files}


def _plan_gencode(primitive: str, save: Path) -> dict[str, list[str]]:
    model_name, _, plan, config_kwargs = CASES[primitive]
    model, make_batch = zoo.build(model_name)
    cfg = ComputeConfig(2, 2, **config_kwargs)
    parallelize(model, make_batch(1, 4), plan, cfg, gen_savedir=save, load_module=False)
    return _gencode_files(save)


def test_each_primitive_trains_like_single_device_and_generates_the_plans_code(tmp_path):
    """One parity run of every 0.8-style policy (one start-up of 2 ranks; the same batch shape as
    below), then each one's generated code against the code of the same choices written as a Plan."""
    cases = [
        ParityCase(
            model_name, p08, 2, config_kwargs=kwargs, nmicros=NMICROS if kwargs else None, optimizer="sgd"
        )
        for model_name, p08, _, kwargs in CASES.values()
    ]
    run_parity_many(cases, 2, tmp_path=tmp_path / "parity", steps=2)
    differ = []
    for k, primitive in enumerate(CASES):
        theirs = _gencode_files(tmp_path / "parity" / "gen" / f"case{k}")
        if theirs != _plan_gencode(primitive, tmp_path / primitive):
            differ.append(primitive)
        if primitive == "recompute":
            assert any("checkpoint" in ln for ln in theirs["gencode0.py"])
        if primitive == "partition":
            assert any("comm.gather_from_group" in ln for ln in theirs["gencode0.py"])
    assert not differ, f"0.8-style policies whose generated code differs from the same Plan's: {differ}"


def test_select_and_nodes_follow_the_transforms_like_nnscaler():
    model, make_batch = zoo.build("gpt")
    front = IRGraph(capture(model, make_batch(1, 4)), 2)
    linears = front.select(name="linear", ntype=IRFwOperation)
    assert [n.origin for n in linears[:2]] == ["linear", "linear_1"] and front.select(
        ntype=IRDataOperation
    ) == []
    assert isinstance(linears[0], IRDimops) and linears[0].input(1).parent.is_param()
    assert (1, 0) in linears[0].transform_space() and linears[0].algorithm("dim").satisfy(idx=1, dim=0, num=2)
    front.staging([front.select(ntype=IRFwOperation)[0], _block_start(front, "transformer.h.1")])
    stages = front.nodes()
    assert all(isinstance(s, IRSegment) for s in stages) and len(stages) == 2
    assert front.segment(linears[0]) is stages[0] and len(front.nodes(flatten=True)) == len(
        front.traced.nodes
    )
    pieces = front.partition(linears[0], linears[0].algorithm("dim"), idx=1, dim=0, num=2)
    selected = front.select(name="linear")
    assert selected[:2] == pieces and linears[0] not in selected and not front.exist(linears[0])
    assert stages[0].nodes()[: len(stages[0].nodes())].count(pieces[0]) == 1 and pieces[1].device == ()
    front.assign(pieces[1], 1)
    assert pieces[1].device == (1,) and front.record.fates["linear"].devices == [None, 1]
