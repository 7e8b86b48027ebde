"""Model families beyond the decoder LMs train exactly as on one device, under every policy.

Each family (tests/zoo_families.py: encoder-decoders, speech, latent attention and experts, a
state-space model, a diffusion UNet, a ViT, ModernBERT) is trained for two SGD steps under dp (1, 2),
tp (2, 2), pp (2, 2) and autodist (2, 2) in one pair of processes, and its losses and every merged
parameter are compared with one-device training. SGD, not Adam: its updates are linear in the
gradient, so a wrong gradient anywhere shows in the parameters (DESIGN.md §4).
"""

from __future__ import annotations

import pytest

from tests.parity import ParityCase, run_parity_many
from tests.zoo_families import FAMILIES

PIPELINE = {"use_end2end": True, "pas_config": {"pipeline_nmicros": 2}}
CONFIG = {"mamba2": {"constant_folding": True}}
"""Per-family ComputeConfig fields: mamba2 also checks constant_folding (its chunked scan's sizes are
written as numbers; the trace itself takes about 20 s with open sizes either way)."""


def _cases(family: str) -> list[ParityCase]:
    model, extra = FAMILIES[family], CONFIG.get(family, {})
    return [
        ParityCase(model, "dp", 1, config_kwargs=extra, optimizer="sgd"),
        ParityCase(model, "tp", 2, config_kwargs=extra, optimizer="sgd"),
        ParityCase(model, "pp", 2, config_kwargs={**PIPELINE, **extra}, nmicros=2, optimizer="sgd"),
        ParityCase(model, "autodist", 2, config_kwargs=extra, optimizer="sgd"),
    ]


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_one_device(family, tmp_path):
    results = run_parity_many(_cases(family), 2, tmp_path=tmp_path, timeout=280)
    tp = results[1]
    assert all(r["local_param_fraction"] < 0.9 for r in tp), (
        f"{family} under tp keeps {max(r['local_param_fraction'] for r in tp):.0%} of its parameters on "
        "each rank: its weights were not split"
    )
