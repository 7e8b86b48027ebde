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
    with pytest.raises(PartitionError, match="not a parameter or buffer"):
        apply_plan(graph, plan, {"no_such_weight": Shard(0)})
