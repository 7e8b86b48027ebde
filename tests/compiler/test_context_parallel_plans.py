"""Context-parallel plans: what `tp` / `hybrid` with cp_size make, what they refuse, and the ring's
P2P program under the NCCL model (a deliberately misordered ring is caught)."""

from __future__ import annotations

import pytest

from nnscaler.config import ComputeConfig
from nnscaler.errors import PartitionError, PlanError
from nnscaler.graph.capture import capture
from nnscaler.mesh import hybrid_cp_subgroups
from nnscaler.partition import apply_plan
from nnscaler.policies.context_parallel import attention_nodes
from nnscaler.policies.cp_schedule import check_ring_nccl, ring_programs
from nnscaler.policies.nccl_sim import Batch
from nnscaler.policies.p2p_plan import Post, Send, Wait
from nnscaler.policies.pipeline import pas_hybrid
from nnscaler.policies.plan import Plan
from nnscaler.policies.tp import pas_tp
from tests import models_long, zoo


@pytest.fixture(scope="module")
def llama():
    model, make_batch = zoo.build("llama")
    return capture(model, make_batch(0, 2))


def _cfg(n: int, **pas) -> ComputeConfig:
    return ComputeConfig(n, n, pas_config=pas)


def _cp_calls(program) -> list:
    return [s for s in program.statements if s.op == "context_parallel.context_parallel_attention"]


def test_cp_alone_splits_the_sequence_and_runs_the_kernel(llama):
    plan = pas_tp(llama, _cfg(2, cp_size=2))
    assert plan.context_parallel.size == 2 and plan.context_parallel.kind == "zigzag" and not plan.mesh
    for node in attention_nodes(llama):
        assert plan.node(node.name).split == "s"
    calls = _cp_calls(apply_plan(llama, plan))
    assert len(calls) == 2 and all(c.kwargs["kind"] == "zigzag" and c.kwargs["is_causal"] for c in calls)
    assert Plan.from_json(plan.to_json()) == plan


def test_cp_with_tp_is_a_cp_by_tp_mesh(llama):
    plan = pas_tp(llama, _cfg(4, cp_size=2, cp_kind="ring"))
    assert plan.mesh == (2, 2) and plan.context_parallel.axis == 0
    for node in attention_nodes(llama):
        seq, heads = plan.node(node.name).mesh_splits
        assert seq[0] == "s" and heads[0] is not None  # sequence on axis 0, kv-head groups on axis 1
    (call, *_) = _cp_calls(apply_plan(llama, plan))
    assert call.kwargs["group"].axis == 0 and call.kwargs["kind"] == "ring"


def test_hybrid_kind_and_pipeline(llama):
    plan = pas_tp(llama, _cfg(4, cp_size=4, cp_kind="hybrid"))
    assert plan.context_parallel.ulysses_size == 2
    assert hybrid_cp_subgroups([0, 1, 2, 3], 2) == [[0, 1], [2, 3], [0, 2], [1, 3]]
    cfg = ComputeConfig(
        4, 4, use_end2end=True, pas_config={"cp_size": 2, "pp_size": 2, "pipeline_nmicros": 2}
    )
    piped = pas_hybrid(llama, cfg)
    assert piped.pipeline.pp_size == 2 and piped.tp_size == 2 and piped.context_parallel.size == 2


def test_refusals_name_the_fix(llama):
    with pytest.raises(PlanError, match="does not divide plan_ngpus"):
        pas_tp(llama, _cfg(4, cp_size=3))
    with pytest.raises(PlanError, match="query heads per tensor-parallel device"):
        pas_tp(llama, _cfg(8, cp_size=8, cp_kind="ulysses"))  # 4 heads, 8 Ulysses devices
    with pytest.raises(PlanError, match="sequence length divisible by 32"):
        pas_tp(llama, _cfg(16, cp_size=16))  # 16 tokens in 32 zigzag chunks
    with pytest.raises(PlanError, match="cp_ulysses_size"):
        pas_tp(llama, _cfg(4, cp_size=4, cp_kind="hybrid", cp_ulysses_size=4))
    mlp, make_batch = zoo.build("mlp")
    with pytest.raises(PlanError, match="no self-attention"):
        pas_tp(capture(mlp, make_batch(0, 2)), _cfg(2, cp_size=2))


def test_attention_dropout_is_refused_with_the_source_line():
    from examples.nanogpt.model import GPT, GPTConfig

    model = GPT(GPTConfig(block_size=32, vocab_size=64, n_layer=1, n_head=2, n_embd=16, dropout=0.1)).train()
    batch = models_long._tokens(64, 16, "idx", "targets", shift=True)(0, 2)
    graph = capture(model, batch)
    with pytest.raises(PartitionError, match=r"model.py:\d+.*attention dropout \(p=0.1"):
        apply_plan(graph, pas_tp(graph, _cfg(2, cp_size=2)))


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_ring_program_passes_the_nccl_model(n):
    check_ring_nccl(n, calls=3)


def _unbatched(programs):
    return [[op for step in p for op in (step.ops if isinstance(step, Batch) else (step,))] for p in programs]


def _reversed_on(programs, rank: int):
    """One rank issues its receive before its send and waits before sending (a blocking recv first)."""
    out = [list(p) for p in programs]
    fixed = []
    steps = out[rank]
    i = 0
    while i < len(steps):
        if isinstance(steps[i], Send) and i + 2 < len(steps) + 1:
            send, post, wait = steps[i], steps[i + 1], steps[i + 2]
            fixed += [post, wait, send]
            i += 3
        else:
            fixed.append(steps[i])
            i += 1
    out[rank] = fixed
    return out


def test_a_misordered_ring_is_caught():
    # two devices: send and receive as separate ops, both send first -> rendezvous deadlock
    with pytest.raises(PlanError, match="would hang on NCCL.*deadlock"):
        check_ring_nccl(2, 1, _unbatched(ring_programs(2, 1)))
    # four devices, every rank waits for its receive before sending: nobody sends
    programs = ring_programs(4, 1)
    for rank in range(4):
        programs = _reversed_on(programs, rank)
    with pytest.raises(PlanError, match="would hang on NCCL"):
        check_ring_nccl(4, 1, programs)
    # one rank sends its blocks the other way round the ring
    bad = [list(p) for p in ring_programs(4, 1)]
    bad[1] = [Send(s.msg, 0) if isinstance(s, Send) else s for s in bad[1]]
    with pytest.raises(PlanError, match="would hang on NCCL"):
        check_ring_nccl(4, 1, bad)
    assert all(isinstance(s, (Send, Post, Wait, Batch)) for p in ring_programs(3, 2) for s in p)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_plan_time_ring_program_is_what_the_runtime_kernel_issues(n):
    """The simulator checks the compiler's description; the kernel issues the runtime's: they agree."""
    from nnscaler.runtime.context_parallel import hybrid_subgroups, ring_p2p_steps

    for p, program in enumerate(ring_programs(n, calls=1)):
        ops = [op for step in program for op in (step.ops if isinstance(step, Batch) else (step,))]
        planned = [
            ("send" if isinstance(op, Send) else "recv", op.peer) for op in ops if not isinstance(op, Wait)
        ]
        issued = [(op, peer) for op, peer, _ in ring_p2p_steps(n, "ring")[p]]
        assert planned == issued
    assert hybrid_subgroups(list(range(8)), 2) == hybrid_cp_subgroups(list(range(8)), 2)
