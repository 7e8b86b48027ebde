"""The side-by-side tensor-parallel benchmark (benchmarks/vs_torch_tp.py) compares the same work: on a
tiny Llama over 2 gloo ranks, our `tp` side and torch's `parallelize_module` side (with and without
sequence parallelism) built by the benchmark's own functions compute the same losses step after step
(AdamW), so a plan that dropped a split or a torch plan that mis-sharded a layer would show here."""

from __future__ import annotations

import argparse

import pytest

from tests.dist_util import spawn

TINY = argparse.Namespace(
    layers=2,
    hidden=64,
    intermediate=128,
    heads=4,
    kv_heads=2,
    vocab=256,
    seq=16,
    batch=2,
    warmup=0,
    steps=3,
    threads=1,
    profile=False,
)


def _losses(rank: int, world: int, gen: str) -> dict[str, list[float]]:
    from benchmarks.vs_torch_tp import ours_step, torch_step

    steps = {
        "ours": ours_step(TINY, world, gen)[0],
        "torch": torch_step(TINY, world, sequence_parallel=False)[0],
        "torch_sp": torch_step(TINY, world, sequence_parallel=True)[0],
    }
    return {name: [step() for _ in range(TINY.steps)] for name, step in steps.items()}


def test_tp_sides_compute_the_same_losses(tmp_path):
    per_rank = spawn(_losses, 2, tmp_path, str(tmp_path / "gen"), timeout=180)
    for losses in per_rank:
        assert losses["ours"] == pytest.approx(losses["torch"], rel=1e-4, abs=1e-5)
        assert losses["torch_sp"] == pytest.approx(losses["torch"], rel=1e-4, abs=1e-5)
        assert losses["ours"][-1] < losses["ours"][0]  # the optimizer steps took effect on both sides
    for name, losses in per_rank[0].items():  # every tp rank sees the same loss
        assert per_rank[1][name] == pytest.approx(losses, rel=1e-6), name
