"""A stack of unequal layers (state-space, attention, experts: tests/zoo_unequal.py) trains exactly as
on one device under dp, tp, pp and autodist, its pipeline stages cut where the balancer puts them
(inside the experts layers for 4 stages), and a graph network under pp."""

from __future__ import annotations

from tests.parity import ParityCase, run_parity_many

UNEQUAL = "tests.zoo_unequal:build_unequal"
GNN = "tests.zoo_unequal:build_gnn"
PIPELINE = {"use_end2end": True, "pas_config": {"pipeline_nmicros": 2}}
INTERLEAVED = {
    "use_end2end": True,
    "pas_config": {"pipeline_nmicros": 2, "pipeline_scheduler": "1f1b_interleaved"},
}


def test_unequal_stack_matches_one_device(tmp_path):
    cases = [
        ParityCase(UNEQUAL, "dp", 1, optimizer="sgd"),
        ParityCase(UNEQUAL, "tp", 2, optimizer="sgd"),
        ParityCase(UNEQUAL, "pp", 2, config_kwargs=PIPELINE, nmicros=2, optimizer="sgd"),
        ParityCase(UNEQUAL, "pp", 2, config_kwargs=INTERLEAVED, nmicros=2, optimizer="sgd"),
        ParityCase(UNEQUAL, "autodist", 2, optimizer="sgd"),
        ParityCase(GNN, "pp", 2, config_kwargs=PIPELINE, nmicros=2, optimizer="sgd"),
    ]
    results = run_parity_many(cases, 2, tmp_path=tmp_path, timeout=280)
    tp = [r["local_param_fraction"] for r in results[1]]
    assert max(tp) <= 0.6, f"tp 2 keeps {max(tp):.0%} of the unequal stack's parameters on a rank"
    for case, per_rank in zip(cases, results):
        if case.policy == "pp":  # each rank holds one stage's weights, never all or none of them
            fractions = [r["local_param_fraction"] for r in per_rank]
            assert all(0.2 < f < 0.8 for f in fractions), (case.label, fractions)


def test_unequal_stack_hybrid_four_stages(tmp_path):
    """4 virtual stages on 2 groups of 2 devices (tp inside each stage): the stages start inside the
    experts layers (the balancer's finer places) and each stage's tp plan still trains exactly."""
    pas = {
        "pipeline_nmicros": 2,
        "pp_size": 2,
        "pipeline_nstages": 4,
        "pipeline_scheduler": "1f1b_interleaved",
    }
    case = ParityCase(
        UNEQUAL,
        "hybrid",
        4,
        config_kwargs={"use_end2end": True, "pas_config": pas},
        nmicros=2,
        optimizer="sgd",
    )
    run_parity_many([case], 4, tmp_path=tmp_path, timeout=280)
