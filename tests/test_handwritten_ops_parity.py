"""A hand-written MLP stack (tests/zoo_handwritten.py: einsum projections, a GeLU and an RMS norm written
as custom autograd.Functions with no annotation) trains exactly as on one device under dp (1, 2), tp
(2, 2), pp (2, 2), autodist (2, 2) and data (2, 2), SGD, every parameter compared; under tp the einsum
projections are column- and row-parallel around the probed GeLU, so a rank keeps at most 60% of the
parameters; the same for projections by heads ("bsd,hde->bhse", "bhse,hed->bsd": split on h).
"""

from __future__ import annotations

from tests.parity import ParityCase, run_parity_many

MODEL = "tests.zoo_handwritten:build_einsum_gelu"
HEADS = "tests.zoo_handwritten:build_einsum_heads"
PIPELINE = {"use_end2end": True, "pas_config": {"pipeline_nmicros": 2}}


def test_einsum_and_autograd_gelu_mlp_matches_one_device(tmp_path):
    cases = [
        ParityCase(MODEL, "dp", 1, optimizer="sgd"),
        ParityCase(MODEL, "tp", 2, optimizer="sgd"),
        ParityCase(MODEL, "pp", 2, config_kwargs=PIPELINE, nmicros=2, optimizer="sgd"),
        ParityCase(MODEL, "autodist", 2, optimizer="sgd"),
        # the batch split over the plan: the row-wise RmsNorm Function runs on each rank's rows, its
        # weight's gradient summed over them
        ParityCase(MODEL, "data", 2, optimizer="sgd"),
        ParityCase(HEADS, "tp", 2, optimizer="sgd"),
    ]
    results = run_parity_many(cases, 2, tmp_path=tmp_path, timeout=280)
    for k in (1, 5):
        tp = results[k]
        assert all(r["local_param_fraction"] <= 0.6 for r in tp), (
            f"{cases[k].label}: a rank keeps {max(r['local_param_fraction'] for r in tp):.0%} of the "
            "parameters: the einsum projections around the GeLU Function were not split"
        )
