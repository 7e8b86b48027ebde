"""nnscaler.mesh.ParallelDims: the one place ranks are computed (plan, data-parallel and ZeRO axes)."""

from __future__ import annotations

import pytest

from nnscaler import ComputeConfig
from nnscaler.mesh import ParallelDims


def test_axes_of_a_tp2_dp4_run() -> None:
    dims = ParallelDims(plan_ngpus=2, world_size=8, zero_ngroups=2)
    assert dims.dp_size == 4
    assert (dims.replica(5), dims.plan_index(5)) == (2, 1)
    assert dims.plan_group(5) == [4, 5]
    assert dims.dp_group(5) == [1, 3, 5, 7]
    assert dims.plan_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert dims.dp_groups() == [[0, 2, 4, 6], [1, 3, 5, 7]]
    # nnScaler's ZeRO groups: consecutive parts of each data-parallel group, crossed by index
    assert dims.zero_parts([0, 2, 4, 6]) == ([[0, 2], [4, 6]], [[0, 4], [2, 6]])
    parts, crosses = dims.all_zero_groups()
    assert parts == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert crosses == [[0, 4], [2, 6], [1, 5], [3, 7]]
    # every rank is in exactly one plan group and one data-parallel group
    for groups in (dims.plan_groups(), dims.dp_groups(), parts, crosses):
        assert sorted(r for g in groups for r in g) == list(range(8))


def test_compute_config_asks_the_dims() -> None:
    cfg = ComputeConfig(2, 8, use_zero=True, zero_ngroups=2)
    assert cfg.dims == ParallelDims(2, 8, 2)
    assert cfg.get_plan_group(5) == [4, 5] and cfg.dp_size == 4
    # nnScaler's ComputeConfig members
    assert cfg.gpu_config == {"plan_ngpus": 2, "runtime_ngpus": 8}
    assert cfg.module_dedup_group_size == 2 and cfg.optimizer_dedup_group_size == 4
    assert cfg.max_bucket_size_bytes is None
    assert ComputeConfig(1, 2, reducer_bucket_cap_mb=2.0).max_bucket_size_bytes == 2 * 2**20
    assert set(cfg.graph_config) == {
        "constant_folding",
        "user_config",
        "inference_only",
        "end2end_mode",
        "trace_strategy",
    }


def test_bad_layouts_name_the_numbers() -> None:
    with pytest.raises(ValueError, match=r"world_size \(6\) must be a positive multiple of plan_ngpus \(4\)"):
        ParallelDims(4, 6)
    with pytest.raises(ValueError, match="zero_ngroups=3 must divide the data-parallel size 4"):
        ParallelDims(1, 4, 3)
