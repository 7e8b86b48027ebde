"""Attention written by hand trains exactly as on one device, and splits as attention does.

Two decoders written for this test (tests/zoo_attention_variants.py): BLOOM-style ALiBi attention
(`baddbmm` over (batch*heads, s, d) operands, a fused QKV linear, a causal `masked_fill`) and einsum
attention with a learned relative-position bias and a causal `where`. The capture pass
(graph/capture/attention_fuse.py) makes each one scaled_dot_product_attention, so under tp the heads
split (the fused QKV linear column-parallel) and under cp the sequence splits, the bias following its
query rows and key columns. Each model under dp (1, 2), tp (2, 2), pp (2, 2), autodist (2, 2) and cp 2
(zigzag, ulysses), SGD, every parameter compared.
"""

from __future__ import annotations

import pytest

from tests.parity import ParityCase, run_parity_many

ALIBI = "tests.zoo_attention_variants:build_alibi"
EINSUM = "tests.zoo_attention_variants:build_einsum_relpos"
PIPELINE = {"use_end2end": True, "pas_config": {"pipeline_nmicros": 2}}


def _cases(model: str) -> list[ParityCase]:
    return [
        ParityCase(model, "dp", 1, optimizer="sgd"),
        ParityCase(model, "tp", 2, optimizer="sgd"),
        ParityCase(model, "pp", 2, config_kwargs=PIPELINE, nmicros=2, optimizer="sgd"),
        ParityCase(model, "autodist", 2, optimizer="sgd"),
        *(
            ParityCase(model, "tp", 2, {"pas_config": {"cp_size": 2, "cp_kind": kind}}, optimizer="sgd")
            for kind in ("zigzag", "ulysses")
        ),
    ]


@pytest.mark.parametrize("model", [ALIBI, EINSUM], ids=["alibi_baddbmm", "einsum_relpos"])
def test_hand_written_attention_matches_one_device(model, tmp_path):
    results = run_parity_many(_cases(model), 2, tmp_path=tmp_path, timeout=280)
    tp = results[1]
    assert all(r["local_param_fraction"] <= 0.6 for r in tp), (
        f"under tp 2 a rank keeps {max(r['local_param_fraction'] for r in tp):.0%} of the parameters: "
        "the attention's weights were not split by heads"
    )
