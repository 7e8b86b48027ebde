"""Expert parallelism through a pipeline (issue 30): the `hybrid` policy with 2 stages x ep 2 on 4
ranks, 1F1B over 2 micro-batches, against single-device gradient accumulation (tests/parity.py, SGD
steps, every parameter compared) for Mixtral and DeepSeek-V3 (tests/models_moe.py); and each stage's
two ranks together choose the experts one device chooses, micro-batch by micro-batch."""

from __future__ import annotations

import re

import pytest
import torch

from tests.parity import ParityCase, run_parity_many

M = "tests.models_moe:"
NMICROS = 2
MODELS = ["build_mixtral", "build_deepseek_v3"]
EP_CALLS = {"build_mixtral": [1, 1, 1, 1], "build_deepseek_v3": [0, 0, 1, 1]}
"""Expert-parallel experts calls in each rank's code: one MoE layer per stage (DeepSeek-V3's first
layer is dense)."""


def _case(model: str) -> ParityCase:
    pas = {"pp_size": 2, "ep_size": 2, "pipeline_nmicros": NMICROS, "pipeline_scheduler": "1f1b"}
    return ParityCase(
        M + model,
        "hybrid",
        4,
        {"pas_config": pas, "use_end2end": True},
        nmicros=NMICROS,
        optimizer="sgd",
    )


@pytest.mark.timeout(600)
def test_pp2_ep2_1f1b_over_4_ranks(tmp_path):
    """Stage 0 on ranks 0-1 and stage 1 on ranks 2-3, each stage's experts split over its 2 ranks."""
    run_parity_many([_case(m) for m in MODELS], 4, tmp_path=tmp_path, timeout=550)
    # the experts really were split: every MoE layer's ranks (its stage) all-to-all its tokens
    for k, model in enumerate(MODELS):
        codes = sorted((tmp_path / "gen" / f"case{k}").rglob("gencode*.py"))
        calls = [len(re.findall(r"= moe\.expert_parallel_experts\(", c.read_text())) for c in codes]
        assert calls == EP_CALLS[model], f"{model}: expert-parallel experts calls per rank {calls}"


def _routing_worker(rank: int, world: int, root: str) -> dict[str, list]:
    """Each model's experts chosen on this rank during one train_step (both micro-batches)."""
    import nnscaler
    from nnscaler import ComputeConfig
    from nnscaler.runtime.moe import routing_log
    from tests import models_moe

    nnscaler.init()
    out = {}
    for name in MODELS:
        model, make_batch = getattr(models_moe, name)(0)
        cfg = ComputeConfig(4, world, pas_config=_case(name).config_kwargs["pas_config"], use_end2end=True)
        pm = nnscaler.parallelize(model, make_batch(7, 4), "hybrid", cfg, gen_savedir=f"{root}/{name}")
        routing_log.calls = []
        pm.train_step([make_batch(1 + m, 4) for m in range(NMICROS)])
        out[name], routing_log.calls = routing_log.calls, None
    return out


@pytest.mark.timeout(400)
def test_pp2_ep2_router_picks_one_devices_experts(tmp_path):
    """ep 2 inside each stage: the two ranks of a stage record their halves of each micro-batch's
    tokens; together they chose exactly the experts one device chooses, layer by layer."""
    from nnscaler.graph.capture.moe import use_moe_op
    from nnscaler.runtime.moe import routing_log
    from tests import models_moe
    from tests.dist_util import spawn

    per_rank = spawn(_routing_worker, 4, tmp_path, str(tmp_path / "gen"), timeout=350)
    for name in MODELS:
        model, make_batch = getattr(models_moe, name)(0)
        layers = use_moe_op(model)
        routing_log.calls = []
        for m in range(NMICROS):
            model(**make_batch(1 + m, 4))
        ref, routing_log.calls = routing_log.calls, None
        assert len(ref) == NMICROS * len(layers) and layers
        by_stage = {}  # the ranks of a stage record the same calls (its layers, micro-batch order)
        for rank, calls in enumerate(per_rank):
            by_stage.setdefault(rank // 2, []).append(calls[name])
        got = []  # one device's order: per micro-batch, the layers of stage 0 then stage 1
        for m in range(NMICROS):
            for stage in sorted(by_stage):
                first, second = by_stage[stage]
                assert len(first) == len(second), f"{name}: the ranks of stage {stage} ran other layers"
                per_micro = len(first) // NMICROS
                for j in range(m * per_micro, (m + 1) * per_micro):
                    got.append(torch.cat([first[j], second[j]]))
        assert len(got) == len(ref), f"{name}: {len(got)} experts calls over the ranks, one device {len(ref)}"
        for k, (g, r) in enumerate(zip(got, ref)):
            assert torch.equal(g, r), (
                f"{name}: experts call {k}: the ranks chose other experts than one device"
            )
