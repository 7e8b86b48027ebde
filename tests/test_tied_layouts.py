"""Tied weights that stages (or consumers in one stage) want in different layouts (issue 9): a
vocab-parallel embedding (S(0)) reused as a transposed head (`x @ w.T`, einsum, row-parallel S(1)).
Every holder stores the weight in one layout and converts it for its consumers."""

from __future__ import annotations

import pytest

from tests import models_tied
from tests.parity import run_parity

NMICROS = 2
HYBRID = {"pipeline_nmicros": NMICROS, "pipeline_nstages": 2, "pp_size": 2}

PP = {"pipeline_nmicros": NMICROS, "pipeline_nstages": 2}

PARITY = {
    # id: (model builder, policy, plan_ngpus, runtime_ngpus, optimizer, extra config kwargs)
    "hybrid-matmul-sgd": ("build_matmul", "hybrid", 4, 4, "sgd", {"pas_config": HYBRID}),
    "hybrid-einsum-adamw": ("build_einsum", "hybrid", 4, 4, "adamw", {"pas_config": HYBRID}),
    # the last stage's head is row-parallel: stage 0 wants tok_weight S(0), stage 1 S(1)
    "hybrid-rowhead-sgd": ("build_t", "hybrid_row_parallel_head", 4, 4, "sgd", {"pas_config": HYBRID}),
    # one stage: the embedding wants S(0), the head S(1)
    "tp-rowhead-sgd": ("build_t", "tp_row_parallel_head", 2, 2, "sgd", {"use_end2end": False}),
    "pp-embedding-sgd": ("build_embedding", "pp", 2, 2, "sgd", {"pas_config": PP}),
}


@pytest.mark.parametrize("case", list(PARITY))
def test_tied_parity(case, tmp_path):
    builder, policy, plan, runtime, optimizer, config = PARITY[case]
    config = {"use_end2end": True, "pas_config": {"pipeline_nmicros": NMICROS}, **config}
    if not config["use_end2end"]:
        config.pop("pas_config")
    run_parity(
        f"tests.models_tied:{builder}",
        getattr(models_tied, policy, policy),
        plan,
        runtime,
        steps=2,
        tmp_path=tmp_path,
        nmicros=NMICROS if config["use_end2end"] else None,
        optimizer=optimizer,
        atol=1e-6 if optimizer == "sgd" else 1e-5,
        config_kwargs=config,
    )


def test_forced_layout_that_does_not_divide_names_the_weight():
    from nnscaler import ComputeConfig
    from nnscaler.errors import PartitionError
    from nnscaler.graph.capture import capture
    from nnscaler.graph.ir import Shard
    from nnscaler.partition import apply_plan
    from nnscaler.policies import make_plan

    model, make_batch = models_tied.build_matmul(0)
    graph = capture(model, make_batch(1, 2))
    plan = make_plan(graph, "tp", ComputeConfig(2, 2))
    with pytest.raises(PartitionError, match=r"tok_weight.*does not split into 2 x 3"):
        apply_plan(graph, plan, {"tok_weight": Shard(1, 3)})
    with pytest.raises(PartitionError, match=r"tok_weight.*has 2 dims"):
        apply_plan(graph, plan, {"tok_weight": Shard(2)})
    with pytest.raises(PartitionError, match="not a parameter or buffer"):
        apply_plan(graph, plan, {"no_such_weight": Shard(0)})


def _hybrid_program(builder: str, policy="hybrid"):
    from nnscaler import ComputeConfig
    from nnscaler.graph.capture import capture
    from nnscaler.partition import apply_pipeline
    from nnscaler.policies import make_plan

    model, make_batch = getattr(models_tied, builder)(0)
    graph = capture(model, make_batch(1, 4))
    cfg = ComputeConfig(4, 4, use_end2end=True, pas_config=HYBRID)
    return apply_pipeline(graph, make_plan(graph, policy, cfg))


@pytest.mark.parametrize(
    "builder, policy, converts",
    [
        # stage 1 splits `x @ w.T` by vocabulary (`w.T` a weight view split like its consumer): the
        # rows stage 0 stores serve it as they are, nothing converted
        ("build_matmul", "hybrid", None),
        # stage 1's row-parallel head wants columns: an all-to-all from the stored rows
        ("build_t", models_tied.hybrid_row_parallel_head, "all_to_all_in_group"),
    ],
)
@pytest.mark.filterwarnings("ignore::UserWarning")
def test_stages_store_a_tied_weight_alike(builder, policy, converts):
    from nnscaler.graph.ir import Shard

    pprog = _hybrid_program(builder, policy)
    assert pprog.param_stages["tok_weight"] == [0, 1]
    stored = [next(t.layout for t in s.program.tensors if t.name == "tok_weight") for s in pprog.stages]
    assert stored == [Shard(0), Shard(0)]
    comms = [
        st.op
        for st in pprog.stages[1].program.statements
        if st.kind == "comm" and st.args[0].name == "tok_weight"
    ]
    assert comms == ([converts] if converts else [])


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_tied_weight_stored_differently_by_stages_says_what_to_do():
    from nnscaler.codegen.pipeline_view import _tied_groups
    from nnscaler.errors import CodegenError
    from nnscaler.graph.ir import Replicate

    pprog = _hybrid_program("build_matmul")
    assert _tied_groups(pprog) == {"tok_weight": [0, 1]}
    pprog.stages[1].program.layouts["tok_weight"] = Replicate()  # as a hand-built stage might
    with pytest.raises(
        CodegenError, match=r"tok_weight.*different layouts.*forced_layouts=\{'tok_weight': layout\}"
    ):
        _tied_groups(pprog)
