"""Expert parallelism against one device (tests/parity.py, SGD steps, every parameter compared):
Mixtral, Qwen2-MoE, DeepSeek-V3 and a hand-written block (tests/models_moe.py), with ep 4 and ep 2
over 4 ranks, tp 2 x ep 2, and a capacity factor that drops assignments. Cases with the router's
auxiliary losses (the hand-written block's load-balancing and z losses) run without data-parallel
replicas (those losses are not linear in the batch), as do transformers' own auxiliary losses
(Mixtral's and Qwen2-MoE's output_router_logits=True)."""

from __future__ import annotations

import pytest

from tests.parity import ParityCase, run_parity_many

M = "tests.models_moe:"


def _case(model: str, plan: int, ep: int) -> ParityCase:
    return ParityCase(M + model, "tp", plan, {"pas_config": {"ep_size": ep}}, optimizer="sgd")


@pytest.mark.timeout(900)
def test_ep4_and_tp2_ep2_over_4_ranks(tmp_path):
    """One replica: ep 4 (aux losses and capacity dropping included) and tp 2 x ep 2."""
    models = ["build_mixtral", "build_qwen2_moe", "build_deepseek_v3", "build_hand_aux"]
    cases = [_case(m, 4, 4) for m in models]
    cases += [_case(m, 4, 4) for m in ("build_mixtral_capacity", "build_hand_capacity")]
    cases += [
        _case(m, 4, 2) for m in ("build_mixtral", "build_qwen2_moe", "build_deepseek_v3", "build_hand_aux")
    ]
    run_parity_many(cases, 4, tmp_path=tmp_path, timeout=850)


@pytest.mark.timeout(600)
def test_ep2_over_4_ranks(tmp_path):
    """ep 2 inside each plan, two data-parallel replicas of it: experts reduced across replicas only."""
    models = ["build_mixtral", "build_qwen2_moe", "build_deepseek_v3", "build_hand"]
    run_parity_many([_case(m, 2, 2) for m in models], 4, tmp_path=tmp_path, timeout=550)


@pytest.mark.timeout(600)
def test_hf_router_aux_losses_ep4(tmp_path):
    """transformers' load-balancing loss (output_router_logits=True) added to the LM loss, ep 4."""
    cases = [_case(m, 4, 4) for m in ("build_mixtral_aux", "build_qwen2_moe_aux")]
    run_parity_many(cases, 4, tmp_path=tmp_path, timeout=550)
