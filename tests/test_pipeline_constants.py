"""Constants (tensors the forward makes from literals, plain tensor attributes) in pipelines: each stage
loads only those its own code uses, a stage that uses none needs none (T5 and Whisper under `pp` used
to fail there), and a constants file that is missing or lacks a key is named, with the key and the
stages using it, on every rank alike (so no rank waits for another that failed).

Models: tests/models_constants.py (stage 0 = blocks 0-1, stage 1 = blocks 2-3).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import torch

from nnscaler import ComputeConfig
from nnscaler.errors import ConfigError
from nnscaler.parallel.compile import compile_module
from nnscaler.policies import Plan
from tests.models_constants import build, build_early, build_late
from tests.parity import ParityCase, run_parity_many

NMICROS = 2
STAGES = {"pipeline_nmicros": NMICROS, "pipeline_stages": ["blocks.2"]}
BUILDERS = ("build", "build_late", "build_early")
TP_CLUSTER = {  # autodist: tensor parallelism inside the stages is cheapest on this made-up cluster
    "device": {"name": "cpu", "fp32_tflops": 0.01, "mem_bw_gbs": 1e6, "kernel_overhead_us": 0},
    "devices_per_node": 8,
    "intra_node": {"bandwidth_gbs": 100, "latency_us": 10},
}


def _case(builder: str, policy: str, plan_ngpus: int, **pas) -> ParityCase:
    """Stages start at blocks.2, but under autodist, which places them itself (Block is the pivot)."""
    stages = {"pipeline_nmicros": NMICROS} if policy == "autodist" else STAGES
    config = {"use_end2end": True, "pas_config": {**stages, **pas}}
    return ParityCase(f"tests.models_constants:{builder}", policy, plan_ngpus, config, nmicros=NMICROS)


def test_pipeline_constants_parity_two_ranks(tmp_path):
    """pp over ComputeConfig(2, 2): constants of stage 0 only, of stage 1 only, of both; buffers of stage
    1 only; the embedding tied to the head across the stages."""
    run_parity_many([_case(b, "pp", 2) for b in BUILDERS], 2, tmp_path=tmp_path)


def test_pipeline_constants_parity_four_ranks(tmp_path):
    """pp over ComputeConfig(2, 4) (two data-parallel replicas of two stages); hybrid and autodist over
    (4, 4): two stages, each tensor-parallel over two devices (hybrid splits `mix` across them)."""
    cases = [_case(b, "pp", 2) for b in ("build", "build_late")]
    cases.append(_case("build", "hybrid", 4, pipeline_nstages=2))
    cases.append(_case("build_late", "autodist", 4, pipeline_nstages=2, cluster=TP_CLUSTER))
    run_parity_many(cases, 4, tmp_path=tmp_path)
    for k, case in enumerate(cases):
        (path,) = sorted((tmp_path / "gen" / f"case{k}").rglob("plan.json"))
        plan = Plan.from_json(path.read_text())
        assert plan.pipeline is not None and plan.pipeline.pp_size == 2, case.label
        assert plan.tp_size == case.plan_ngpus // 2, case.label


# ---- the generated code and the constants file, in this process (no process group needed) ---------------


@pytest.fixture(scope="module")
def compiled_root(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    """Where each builder's model is compiled, once per module; the outputs so far."""
    return tmp_path_factory.mktemp("constants_compiled"), {}


def _compile(tmp_path: Path, builder, compiled: tuple[Path, dict[str, Path]]) -> Path:
    """A copy (in tmp_path: tests may damage it) of the pp ComputeConfig(2, 2) output of `builder`'s model."""
    root, done = compiled
    name = builder.__name__
    if name not in done:
        model, make_batch = builder()
        cfg = ComputeConfig(2, 2, use_end2end=True, pas_config=STAGES)
        done[name] = compile_module(model, make_batch(0, 4), "pp", cfg, root / name, "test").outdir
    return Path(shutil.copytree(done[name], tmp_path / name))


def _gen_class(outdir: Path, rank: int):
    name = f"_constants_gencode_{abs(hash(str(outdir)))}_{rank}"
    spec = importlib.util.spec_from_file_location(name, outdir / f"gencode{rank}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.GenModel


def _constants(pm) -> dict[str, torch.Tensor]:
    return {
        i.original_name: pm._tensor(n) for n, i in pm.fullmap.items() if i.original_name in pm.constant_users
    }


def test_each_stage_registers_and_loads_only_its_constants(tmp_path, compiled_root):
    model, _ = build()
    outdir = _compile(tmp_path, build, compiled_root)
    values = torch.load(outdir / "constants.pt")
    users = {
        "blocks.0.lifted_tensor_0": "stage 0 (rank 0)",
        "blocks.3.lifted_tensor_1": "stage 1 (rank 1)",
        "mix": "stages 0, 1 (ranks 0, 1)",
    }
    mine = {0: {"blocks.0.lifted_tensor_0", "mix"}, 1: {"blocks.3.lifted_tensor_1", "mix"}}
    for rank in (0, 1):
        cls = _gen_class(outdir, rank)
        assert cls.constant_users == users  # the same on every rank
        pm = cls(init_params=False)
        got = _constants(pm)
        assert set(got) == mine[rank]
        for name, tensor in got.items():
            torch.testing.assert_close(tensor, values[name], rtol=0, atol=0)
        torch.testing.assert_close(got["mix"], model.mix, rtol=0, atol=0)


def test_stage_without_constants_and_initial_weights(tmp_path, compiled_root):
    """build_late: stage 0 uses no constant (it loaded none and failed before). With init_params=True
    from the model's weights (fullmodel.pt's: state dict and buffers, no constants) every rank loads:
    constants come from the file."""
    model, _ = build_late()
    full = {**model.state_dict(), **dict(model.named_buffers())}
    outdir = _compile(tmp_path, build_late, compiled_root)
    for rank in (0, 1):
        cls = _gen_class(outdir, rank)
        assert cls.constant_users == {"blocks.3.lifted_tensor_0": "stage 1 (rank 1)"}
        cls.init_state_dict = full
        pm = cls(init_params=True)
        assert set(_constants(pm)) == ({"blocks.3.lifted_tensor_0"} if rank == 1 else set())
        for name, info in pm.fullmap.items():
            if info.original_name in full:
                torch.testing.assert_close(pm._tensor(name), full[info.original_name], rtol=0, atol=0)


def test_early_constants_only(tmp_path, compiled_root):
    outdir = _compile(tmp_path, build_early, compiled_root)
    for rank in (0, 1):
        pm = _gen_class(outdir, rank)(init_params=False)
        assert pm.constant_users == {"blocks.0.lifted_tensor_0": "stage 0 (rank 0)"}
        assert set(_constants(pm)) == ({"blocks.0.lifted_tensor_0"} if rank == 0 else set())


def test_missing_constant_is_named_on_every_rank(tmp_path, compiled_root):
    """A constants file lacking the key stage 1 uses: both ranks raise (rank 0 too, though it does not
    use it, so it does not wait in a collective for rank 1), naming the file, the key and its users."""
    outdir = _compile(tmp_path, build_late, compiled_root)
    path = outdir / "constants.pt"
    values = torch.load(path)
    torch.save(
        {k: v for k, v in values.items() if k != "blocks.3.lifted_tensor_0"} | {"other": torch.ones(2)}, path
    )
    for rank in (0, 1):
        cls = _gen_class(outdir, rank)
        with pytest.raises(ConfigError) as err:
            cls(init_params=False)
        msg = str(err.value)
        assert f"GenModel of rank {rank}" in msg, msg
        assert str(path) in msg and "lacks 'blocks.3.lifted_tensor_0', used by stage 1 (rank 1)" in msg, msg
        assert "'other'" in msg and "reuse='moo'" in msg, msg


def test_missing_or_damaged_constants_file(tmp_path, compiled_root):
    outdir = _compile(tmp_path, build, compiled_root)
    path = outdir / "constants.pt"
    path.write_bytes(b"not a torch file")
    with pytest.raises(ConfigError, match=r"constants file .*constants\.pt cannot be read"):
        _gen_class(outdir, 1)(init_params=False)
    path.unlink()
    for rank in (0, 1):
        with pytest.raises(ConfigError, match=rf"rank {rank}: the constants file .*constants\.pt is missing"):
            _gen_class(outdir, rank)(init_params=False)


def test_constant_of_wrong_shape(tmp_path, compiled_root):
    outdir = _compile(tmp_path, build_early, compiled_root)
    torch.save({"blocks.0.lifted_tensor_0": torch.ones(3)}, outdir / "constants.pt")
    with pytest.raises(
        ConfigError, match=r"holds 'blocks\.0\.lifted_tensor_0' with shape \[3\], but the code"
    ):
        _gen_class(outdir, 0)(init_params=False)
