"""NnScalerFabricStrategy on 4 ranks with pipelines: two stages times two data-parallel replicas
(plain, and with ZeRO-2 over the replicas; ZeRO-3 with pipeline stages is refused by `parallelize`
itself, with a PlanError naming zero_stage), and two stages with tensor parallelism inside each
('hybrid'). Each trains like one device on the replicas' batches, resumes exactly from `fabric.load`,
evaluates like the plain module, and merges to its weights (tests/integration/fabric_case.py).

Run as `torchrun --nproc_per_node 4 -m tests.integration.test_fabric_pipeline OUT` by the fixture."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.integration.fabric_case import PIPELINE, check_run, launch, main

WORLD = 4
RUNS = {
    "pp_dp": ("pp", 2, PIPELINE),
    "pp_zero2": ("pp", 2, {**PIPELINE, "use_zero": True, "zero_stage": 2}),
    "hybrid": ("hybrid", 4, PIPELINE),  # 2 stages x tp 2
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    return launch("tests.integration.test_fabric_pipeline", tmp_path_factory.mktemp("fabric_pp"), WORLD)


@pytest.mark.parametrize("name", list(RUNS))
def test_fabric_pipeline_matches_one_device_and_resumes(runs, tmp_path, name):
    check_run(runs, tmp_path, name, RUNS[name], WORLD)


if __name__ == "__main__":
    main(Path(sys.argv[1]), RUNS, WORLD)
