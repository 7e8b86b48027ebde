"""A speech CTC model with a label-range check in its top forward trains like one device under every
policy (issue 40): the check traces as an assumption (graph/capture/value_checks.py), so the model is
one graph that tp splits and pp cuts into stages, and the generated code checks each rank's labels.

Model: tests/models_ctc.py (Conv1d + Linear frontend over log-mel-like features, two transformer
encoder layers with F.scaled_dot_product_attention, a linear CTC head, F.ctc_loss).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist_util import spawn
from tests.models_ctc import VOCAB, bad_batch
from tests.parity import ParityCase, run_parity_many

MODEL = "tests.models_ctc:build_speech_ctc"
LINEAR_FRONTEND = "tests.models_ctc:build_speech_ctc_linear"
"""Context parallelism splits the sequence from the input on: a convolution over time keeps it whole
(graph/ops/conv.py: spatial dims are never split), so the cp cases use a per-frame linear frontend."""


class CheckedMLP(nn.Module):
    """A check on an activation the plan splits (tp: the hidden features)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x, y):
        h = F.gelu(self.fc1(x))
        assert torch.isfinite(h).all(), "hidden activations are not finite"
        return F.mse_loss(self.fc2(h), y)


def build_checked_mlp(seed: int = 0):
    torch.manual_seed(seed)

    def make_batch(seed: int, batch_size: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {"x": torch.randn(batch_size, 16, generator=g), "y": torch.randn(batch_size, 8, generator=g)}

    return CheckedMLP().train(), make_batch


def _cp(kind: str) -> ParityCase:
    return ParityCase(
        LINEAR_FRONTEND, "tp", 2, {"pas_config": {"cp_size": 2, "cp_kind": kind}}, optimizer="sgd"
    )


def test_ctc_with_label_check_is_exact_under_every_policy(tmp_path):
    pp = {"use_end2end": True, "pas_config": {"pipeline_nmicros": 2}}
    cases = [
        ParityCase(MODEL, "dp", 1, optimizer="sgd"),
        ParityCase(MODEL, "tp", 2, optimizer="sgd"),
        ParityCase(MODEL, "pp", 2, pp, nmicros=2, optimizer="sgd"),
        ParityCase(MODEL, "autodist", 2, optimizer="sgd"),
        _cp("zigzag"),
        _cp("ulysses"),
        ParityCase(MODEL, "data", 2, optimizer="sgd"),  # the batch split through the CTC loss
        ParityCase(f"{__name__}:build_checked_mlp", "tp", 2, optimizer="sgd"),
        ParityCase(f"{__name__}:build_checked_mlp", "autodist", 2, optimizer="sgd"),
    ]
    results = run_parity_many(cases, 2, tmp_path=tmp_path, timeout=600)
    tp = results[1]
    assert all(r["local_param_fraction"] <= 0.6 for r in tp), [r["local_param_fraction"] for r in tp]
    # the check reads the labels each rank holds whole: no communication before it
    for case in ("case1", "case3"):  # tp, autodist
        for rank in (0, 1):
            source = next((tmp_path / "gen" / case).rglob(f"gencode{rank}.py")).read_text()
            before, check, _ = source.partition("nnscaler.runtime.checks.raise_if(ge, ValueError")
            assert check and "comm." not in before.split("def forward", 1)[1], (case, rank)
    stage0 = next((tmp_path / "gen" / "case2").rglob("gencode0.py")).read_text()
    assert "nnscaler.runtime.checks.raise_if(" in stage0  # pp: the first stage, which reads the labels
    # a check on a split activation checks each rank's elements: nothing gathered, Megatron's pattern kept
    mlp = next((tmp_path / "gen" / "case7").rglob("gencode0.py")).read_text()
    assert "raise_unless(isfinite, AssertionError" in mlp and "gather" not in mlp, mlp
    assert all(r["local_param_fraction"] <= 0.6 for r in results[7])


def _train_with_a_bad_label(
    rank: int, world_size: int, policy: str, plan_ngpus: int, gen_savedir: str
) -> str:
    """One step on good labels, then a step where data-parallel replica 1 (or, under tp, both ranks of
    the plan) gets a label out of the vocabulary; returns 'ok' or the error the rank raised."""
    import nnscaler
    from nnscaler import ComputeConfig, parallelize
    from tests.models_ctc import build_speech_ctc

    nnscaler.init()
    model, make_batch = build_speech_ctc()
    pm = parallelize(
        model, make_batch(1, 4), policy, ComputeConfig(plan_ngpus, world_size), gen_savedir=gen_savedir
    )
    pm(**make_batch(2, 4)).backward()
    replica = rank // plan_ngpus
    batch = bad_batch(3, 4) if replica == world_size // plan_ngpus - 1 else make_batch(3, 4)
    try:
        pm(**batch)
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc} | {' '.join(getattr(exc, '__notes__', []))}"
    return "ok"


@pytest.mark.parametrize("policy,plan_ngpus", [("dp", 1), ("tp", 2)])
def test_a_wrong_label_raises_on_the_rank_that_sees_it(policy, plan_ngpus, tmp_path):
    out = spawn(_train_with_a_bad_label, 2, tmp_path, policy, plan_ngpus, str(tmp_path / "gen"), timeout=300)
    message = f"ValueError: labels must be < {VOCAB} (the CTC head's vocabulary)"
    if plan_ngpus == 1:  # replica 1 got the bad label; replica 0 trains on
        assert out[0] == "ok", out
        assert out[1].startswith(message) and "models_ctc.py:" in out[1] and "rank 1" in out[1], out
    else:  # both ranks of the plan hold the whole labels: both raise
        assert all(o.startswith(message) for o in out), out
