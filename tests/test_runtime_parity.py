"""Issue 5 through parallelize: the async bucketed reducer and ZeRO (stages 1-3) train exactly like one device."""

from __future__ import annotations

import pytest

from tests.parity import run_parity

CASES = {
    "async-buckets": ("tp", 2, 4, dict(use_async_reducer=True, reducer_bucket_cap_mb=0.01)),
    "sync-buckets": ("tp", 2, 4, dict(use_async_reducer=False, reducer_bucket_cap_mb=0.01)),
    "zero1-ngroups1-sync": ("dp", 1, 4, dict(use_zero=True, zero_ngroups=1, use_async_reducer=False)),
    "zero1-ngroups2-async": ("dp", 1, 4, dict(use_zero=True, zero_ngroups=2, use_async_reducer=True)),
    "zero1-reduce-scatter-tp": ("tp", 2, 4, dict(use_zero=True, zero_use_reduce_scatter=True)),
    "zero2-tp": ("tp", 2, 4, dict(use_zero=True, zero_stage=2, reducer_bucket_cap_mb=0.01)),
    "zero3-ngroups1": ("dp", 1, 4, dict(use_zero=True, zero_stage=3, zero_ngroups=1)),
    "zero3-tp": ("tp", 2, 4, dict(use_zero=True, zero_stage=3)),
    # recomputed blocks fetch their parameters again in backward, outside forward
    "zero3-ngroups2-recompute": (
        "dp",
        1,
        4,
        dict(use_zero=True, zero_stage=3, zero_ngroups=2, pas_config={"recompute_modules": "Block"}),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gpt_parity(case, tmp_path):
    policy, plan, runtime, kwargs = CASES[case]
    run_parity("gpt", policy, plan, runtime, tmp_path=tmp_path, config_kwargs=kwargs)
