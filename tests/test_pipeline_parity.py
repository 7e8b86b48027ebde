"""Pipeline parity (issue 4): 4 gloo ranks, each schedule, against single-device gradient accumulation
over the same micro-batches (tests/parity.py with `nmicros`)."""

from __future__ import annotations

import pytest

from tests.parity import run_parity

NMICROS = 4

CASES = {
    # id: (model, policy, plan_ngpus, runtime_ngpus, extra pas_config)
    "gpt-pp4-gpipe": ("gpt_deep", "pp", 4, 4, {"pipeline_scheduler": "gpipe"}),
    # recomputed blocks inside the stages: checkpoint regions in the stage methods
    "gpt-pp4-1f1b-recompute": (
        "gpt_deep",
        "pp",
        4,
        4,
        {"pipeline_scheduler": "1f1b", "recompute_modules": "Block"},
    ),
    "gpt-pp4x2-interleaved": ("gpt_deep", "pp", 4, 4, {"pipeline_scheduler": "1f1b_interleaved"}),
    "gpt-hybrid-2x2": ("gpt", "hybrid", 4, 4, {"pipeline_nstages": 2}),
    "gpt-hybrid-2-dp2": ("gpt", "hybrid", 2, 4, {"pipeline_nstages": 2}),
    "llama-pp4-gpipe": ("llama_deep", "pp", 4, 4, {"pipeline_scheduler": "gpipe"}),
    "llama-pp4-1f1b": ("llama_deep", "pp", 4, 4, {"pipeline_scheduler": "1f1b"}),
    "llama-pp4x2-interleaved": ("llama_deep", "pp", 4, 4, {"pipeline_scheduler": "1f1b_interleaved"}),
    "llama-hybrid-2x2": ("llama", "hybrid", 4, 4, {"pipeline_nstages": 2}),
    "llama-hybrid-2-dp2": ("llama", "hybrid", 2, 4, {"pipeline_nstages": 2}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pipeline_parity(case, tmp_path):
    model, policy, plan, runtime, extra = CASES[case]
    pas_config = {"pipeline_nmicros": NMICROS, **extra}
    run_parity(
        model,
        policy,
        plan,
        runtime,
        steps=2,
        tmp_path=tmp_path,
        nmicros=NMICROS,
        config_kwargs={"use_end2end": True, "pas_config": pas_config},
    )


def test_end2end_without_pipeline(tmp_path):
    """train_step also drives plain data / tensor parallel plans: micro-batch gradients add up."""
    run_parity(
        "gpt",
        "tp",
        2,
        4,
        steps=2,
        tmp_path=tmp_path,
        nmicros=2,
        config_kwargs={"use_end2end": True},
    )


def test_pipeline_with_zero_and_sgd(tmp_path):
    """SGD sees the gradient's scale: the sum over micro-batches and the mean over replicas must be
    right, also with the tied embedding's gradient summed across stages and ZeRO on the replicas
    (synchronous reducer: every bucket is reduced after the schedule)."""
    results = run_parity(
        "gpt",
        "pp",
        2,
        4,
        steps=2,
        tmp_path=tmp_path,
        nmicros=2,
        optimizer="sgd",
        atol=1e-6,
        config_kwargs={
            "use_end2end": True,
            "use_zero": True,
            "use_async_reducer": False,
            "pas_config": {"pipeline_nmicros": 2},
        },
    )
    assert all(r["launched_in_backward"] == [0, 0] for r in results)


@pytest.mark.parametrize("model,scheduler", [("gpt", "1f1b"), ("gpt_deep", "1f1b_interleaved")])
def test_pipeline_overlaps_last_micro_batch_reduction(model, scheduler, tmp_path):
    """Default (async) reducer: the schedule runs under no_sync except the last micro-batch's backward,
    which launches the buckets as they fill (overlapped with the rest of backward and the last sends);
    gradients still sum over micro-batches and average over replicas exactly (SGD)."""
    nmicros = 4
    results = run_parity(
        model,
        "pp",
        2,
        4,
        steps=2,
        tmp_path=tmp_path,
        nmicros=nmicros,
        optimizer="sgd",
        atol=1e-6,
        config_kwargs={
            "use_end2end": True,
            "reducer_bucket_cap_mb": 0.05,
            "pas_config": {"pipeline_nmicros": nmicros, "pipeline_scheduler": scheduler},
        },
    )
    for r in results:
        assert len(r["launched_in_backward"]) == 2 and min(r["launched_in_backward"]) > 0, (
            f"rank {r['rank']}: no bucket reduction was launched during backward: {r['launched_in_backward']}"
        )
