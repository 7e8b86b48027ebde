"""NnScalerFabricStrategy on 2 ranks: a Fabric loop under dp, tp, dp + ZeRO-2, dp + ZeRO-3 and a
two-stage pipeline trains like one device, evaluates like it, saves a checkpoint directory that
`fabric.load` restores exactly and `merge_checkpoint` merges to the plain module's weights
(tests/integration/fabric_case.py). 4 ranks (pipelines with replicas, ZeRO, tp inside stages):
test_fabric_pipeline.py.

Run as `torchrun --nproc_per_node 2 -m tests.integration.test_lightning_fabric OUT` by the fixture
(the runs one after the other in the same processes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from nnscaler.errors import ConfigError
from tests.integration.fabric_case import PIPELINE, check_run, launch, main

WORLD = 2
RUNS = {
    "dp": ("dp", 1, {}),
    "tp": ("tp", 2, {}),
    "zero2": ("dp", 1, {"use_zero": True, "zero_stage": 2}),
    "zero3": ("dp", 1, {"use_zero": True, "zero_stage": 3}),
    "pp": ("pp", 2, PIPELINE),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return launch("tests.integration.test_lightning_fabric", tmp_path_factory.mktemp("fabric"), WORLD)


@pytest.mark.parametrize("name", list(RUNS))
def test_fabric_matches_one_device_and_resumes(runs, tmp_path, name):
    check_run(runs, tmp_path, name, RUNS[name], WORLD)


def test_fabric_strategy_arguments_are_checked():
    from nnscaler import ComputeConfig
    from nnscaler.integration.lightning.fabric import NnScalerFabricStrategy

    with pytest.raises(ConfigError, match="compute_config"):
        NnScalerFabricStrategy(pas_policy="dp")
    with pytest.raises(ConfigError, match="pas_policy"):
        NnScalerFabricStrategy(compute_config=ComputeConfig(2, 2, use_end2end=True))


if __name__ == "__main__":
    main(Path(sys.argv[1]), RUNS, WORLD)
