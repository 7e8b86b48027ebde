"""Policies in the style of nnScaler 0.8's built-ins (pas_dp, pas_tp, pas_data, pas_hybrid) and swin's
Megatron policy, written here against the 0.8 policy API (small versions, not nnScaler's code), run
as custom policies and train like the single-device model (2 ranks, gloo, SGD)."""

from __future__ import annotations

import random

from nnscaler import ComputeConfig
from nnscaler.graph import IRGraph
from nnscaler.graph.function.anchor import IRGraphAnchor
from nnscaler.graph.function.dimops import IRDimops
from nnscaler.graph.segment import IRSegment
from nnscaler.ir import IRCell, IRFullTensor, IRSubTensor
from nnscaler.ir.operator import IRDataOperation, IRFwOperation
from tests.parity import ParityCase, run_parity_many


def split(graph: IRGraph, node, devs: list[int], idx: int, dim: int) -> list:
    subs = (
        graph.partition(node, node.algorithm("dim"), idx=idx, dim=dim, num=len(devs))
        if len(devs) > 1
        else [node]
    )
    for dev, sub in zip(devs, subs):
        graph.assign(sub, dev)
    return subs


def copies(graph: IRGraph, node, devs: list[int]) -> list:
    subs = graph.replicate(node, times=len(devs))
    for dev, sub in zip(devs, subs):
        graph.assign(sub, dev)
    return subs


def mark_multiref(graph: IRGraph) -> None:
    """nnScaler's auto_multiref: tensors read by several consumers (a no-op for our partitioner)."""
    outputs = [
        t.parent for t in IRCell.get_objects_from_complex(graph.outputs()) if isinstance(t, IRSubTensor)
    ]
    for ftensor in graph.full_tensors():
        assert isinstance(ftensor, IRFullTensor) and not ftensor.is_grad()
        if len(graph.consumers(ftensor)) + (ftensor in outputs) > 1:
            graph.multiref(ftensor, comment="auto_multiref")


def dp_style(graph: IRGraph, cfg: ComputeConfig) -> IRGraph:
    assert cfg.plan_ngpus == 1
    for node in graph.select(ntype=(IRFwOperation, IRDataOperation)):
        copies(graph, node, [0])
    return graph


def tp_style(graph: IRGraph, cfg: ComputeConfig) -> IRGraph:
    """A random split per op among those its annotation allows (seeded: every rank picks the same)."""
    devs, rng = list(range(cfg.plan_ngpus)), random.Random(1)
    mark_multiref(graph)
    for node in graph.select(ntype=(IRFwOperation, IRDataOperation)):
        if node.name == "multiref" or isinstance(node, IRGraphAnchor):
            continue
        space = node.transform_space() if isinstance(node, IRDimops) else []
        rng.shuffle(space)
        for idx, dim in space:
            if node.input(idx).shape[dim] % len(devs) == 0 and node.algorithm("dim").satisfy(
                idx=idx, dim=dim, num=len(devs)
            ):
                split(graph, node, devs, idx, dim)
                break
        else:
            copies(graph, node, devs)
    return graph


def data_style(graph: IRGraph, cfg: ComputeConfig) -> IRGraph:
    """Dim 0 of each op's first input split over the plan devices; ops that cannot, replicated."""
    ngpus = cfg.plan_ngpus
    mark_multiref(graph)
    for loader in graph.select(ntype=IRDataOperation):
        copies(graph, loader, list(range(ngpus)))
    for node in graph.nodes():
        if isinstance(node, IRFwOperation):
            try:
                subs = graph.partition(node, node.algorithm("dim"), idx=0, dim=0, num=ngpus)
            except Exception:
                subs = graph.replicate(node, ngpus)
            for dev, sub in enumerate(subs):
                graph.assign(sub, dev)
    return graph


def hybrid_style(graph: IRGraph, cfg: ComputeConfig) -> IRGraph:
    """Stages of equal op counts, one device group each, dim 0 of input 0 split inside a stage."""
    nstages, nmicros = cfg.pas_config["pipeline_nstages"], cfg.pas_config["pipeline_nmicros"]
    tp_size = cfg.plan_ngpus // nstages
    ops = graph.select(ntype=IRFwOperation)
    per = -(-len(ops) // nstages)
    graph.staging([ops[k * per] for k in range(nstages)])
    stages = [s for s in graph.select(ntype=IRSegment, flatten=False) if s.isfw()]
    assert len(stages) == nstages
    for k, stage in enumerate(stages):
        devs = list(range(k * tp_size, (k + 1) * tp_size))
        for node in stage.nodes():
            try:
                split(graph, node, devs, idx=0, dim=0)
            except Exception:
                copies(graph, node, devs)
    cfg.apply_pipeline_scheduler(graph, nstages, nmicros, cfg.pas_config.get("pipeline_scheduler", "1f1b"))
    return graph


def megatron_style(graph: IRGraph, cfg: ComputeConfig) -> IRGraph:
    """swin's pas_megatron idiom: chosen ops by name split on their weight, the rest replicated."""
    devs = list(range(cfg.plan_ngpus))
    for node in graph.select(name="linear"):
        if "mlp.c_fc" in next(reversed(node.module_stack), ""):
            split(graph, node, devs, idx=1, dim=0)
    for node in graph.select(ntype=(IRFwOperation, IRDataOperation)):
        if len(node.device) == 0:
            copies(graph, node, devs)
    return graph


def registered_op_style(graph: IRGraph, cfg: ComputeConfig) -> IRGraph:
    """swin's idiom for its register_op'd ops: select one by its function's name, split its hidden dim."""
    devs = list(range(cfg.plan_ngpus))
    (node,) = graph.select(name="swiglu", ntype=IRDimops)
    split(graph, node, devs, idx=0, dim=-1)
    for node in graph.select(ntype=IRFwOperation):
        if not node.device:
            copies(graph, node, devs)
    return graph


def test_nnscaler08_style_builtin_policies_train_like_single_device(tmp_path):
    hybrid = {"use_end2end": True, "pas_config": {"pipeline_nstages": 2, "pipeline_nmicros": 2}}
    cases = [
        ParityCase("mlp", dp_style, 1, optimizer="sgd"),
        ParityCase("mlp", tp_style, 2, optimizer="sgd"),
        # a random split of GPT's attention: its output leaves an all-to-all contiguous where capture
        # saw a transposed layout, and the `.view` after the transpose must still hold
        ParityCase("gpt", tp_style, 2, optimizer="sgd"),
        ParityCase("mlp", data_style, 2, optimizer="sgd"),
        ParityCase("gpt", hybrid_style, 2, config_kwargs=hybrid, nmicros=2, optimizer="sgd"),
        ParityCase("gpt", megatron_style, 2, optimizer="sgd"),
        ParityCase("userops", registered_op_style, 2, optimizer="sgd"),
    ]
    results = run_parity_many(cases, 2, tmp_path=tmp_path, steps=2)
    assert len(results) == len(cases)
