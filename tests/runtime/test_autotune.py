"""Bucket autotuning (runtime/autotune.py) on 2 gloo ranks: the reducer is rebuilt with each candidate
size between steps, training stays equal to single-device SGD throughout, and both ranks keep the same
size, the one with the lowest slowest-rank median."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from nnscaler.config import ComputeConfig
from nnscaler.errors import ConfigError
from nnscaler.runtime import build_optimizer
from nnscaler.runtime.grads.autotune import BucketAutotuner
from nnscaler.runtime.grads.reducer import make_buckets

try:
    from .dist_util import run_dist
    from .test_module import LR, _setup
    from .test_reducer import TINY_MB, _gen, _params_match, _rows
except ImportError:
    from dist_util import run_dist
    from test_module import LR, _setup
    from test_reducer import TINY_MB, _gen, _params_match, _rows

CANDIDATES = (TINY_MB, 3e-4, 25.0)


def autotune_worker(rank: int, world: int) -> dict[str, Any]:
    ref, full, x, t = _setup()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    pm = _gen(rank, world, 1, ComputeConfig(1, world, reducer_bucket_autotune=True), full)
    pm._autotune = BucketAutotuner(candidates=CANDIDATES, steps_per_candidate=2)
    opt = build_optimizer(pm, torch.optim.SGD, lr=LR)
    rows = _rows(rank, world, 1)
    buckets_per_step = []
    for step in range(len(CANDIDATES) * 2 + 2):
        pm(x[rows], t[rows]).backward()
        buckets_per_step.append(len(pm.reducer.buckets))
        ref(x, t).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        _params_match(pm, ref, f"rank {rank}, step {step}")
    tuner = pm._autotune
    assert tuner.chosen in CANDIDATES and len(tuner.scores) == len(CANDIDATES)
    assert tuner.chosen == CANDIDATES[min(range(3), key=tuner.scores.__getitem__)]
    params = [p for p in pm.parameters() if p.requires_grad]
    assert len(pm.reducer.buckets) == len(make_buckets(params[::-1], tuner.chosen))
    want = [len(make_buckets(params[::-1], mb)) for mb in CANDIDATES]
    return {"buckets": buckets_per_step, "want": want, "chosen": tuner.chosen, "scores": tuner.scores}


def test_autotune_tries_each_size_and_keeps_the_fastest() -> None:
    results = run_dist(autotune_worker, 2)
    a, b = results
    assert a["chosen"] == b["chosen"] and a["scores"] == b["scores"], "the ranks agree"
    want = a["want"]
    assert want[0] > want[1] > want[2] == 1, want  # the candidates make different buckets
    assert a["buckets"][:6] == [want[0], want[0], want[1], want[1], want[2], want[2]]


def test_autotune_refuses_zero() -> None:
    with pytest.raises(ConfigError, match="reducer_bucket_autotune=True.*use_zero=True"):
        ComputeConfig(1, 2, use_zero=True, reducer_bucket_autotune=True)
    with pytest.raises(ValueError, match="at least 2 steps"):
        BucketAutotuner(steps_per_candidate=1)
