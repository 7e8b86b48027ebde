"""NnScalerFabricStrategy: a Fabric loop under dp, tp and dp + ZeRO-2 trains like one device, saves a
checkpoint directory that `fabric.load` restores exactly and `merge_checkpoint` merges to the plain
module's weights.

Run as `torchrun --nproc_per_node 2 -m tests.integration.test_lightning_fabric OUT` by the fixture
(the three runs one after the other in the same processes)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nnscaler.errors import ConfigError
from tests.integration.lightning_case import BATCH, LR, SAMPLES, Pairs, Regressor, reference_weights

ROOT = Path(__file__).resolve().parents[2]
RUNS = {"dp": ("dp", 1, {}), "tp": ("tp", 2, {}), "zero2": ("dp", 1, {"use_zero": True, "zero_stage": 2})}
STEPS = 3


def _batch(data: Pairs, step: int, replica: int, replicas: int) -> dict[str, torch.Tensor]:
    """What Lightning's DistributedSampler(shuffle=True, seed=0) gives replica `replica` (reference_weights)."""
    perm = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0))
    idx = perm[replica::replicas][step * BATCH : (step + 1) * BATCH]
    return {"x": data.x[idx], "y": data.y[idx]}


def _run(out: Path, name: str) -> dict:
    import lightning as L

    from nnscaler import ComputeConfig
    from nnscaler.integration.lightning.fabric import NnScalerFabricStrategy

    policy, plan, cfg = RUNS[name]
    strategy = NnScalerFabricStrategy(
        compute_config=ComputeConfig(plan, 2, **cfg), pas_policy=policy, gen_savedir=str(out / "gen" / name)
    )
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    module = Regressor()
    model, opt = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=LR))
    data, replicas = Pairs(), 2 // plan
    replica = fabric.global_rank // plan

    def step(s: int) -> float:
        loss = model(**_batch(data, s, replica, replicas))
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=100.0)
        opt.step()
        opt.zero_grad()
        return float(fabric.all_reduce(loss.detach(), reduce_op="mean"))

    losses = [step(s) for s in range(STEPS - 1)]
    fabric.save(out / f"{name}_step2.ckpt", {"model": model, "optimizer": opt, "step": STEPS - 1})
    losses.append(step(STEPS - 1))
    fabric.save(out / f"{name}.ckpt", {"model": model, "optimizer": opt, "step": STEPS})
    after = {k: v.clone() for k, v in strategy.parallel_module.state_dict().items() if torch.is_tensor(v)}
    state = {"model": model, "optimizer": opt, "step": 0}
    rest = fabric.load(out / f"{name}_step2.ckpt", state)
    back = strategy.parallel_module.state_dict()
    restored = any(not torch.equal(back[k], v) for k, v in after.items())  # weights of step 2 again
    step(STEPS - 1)
    again = strategy.parallel_module.state_dict()
    replayed = all(torch.equal(again[k], v) for k, v in after.items())
    return {
        "losses": losses,
        "step": state["step"],
        "rest": sorted(rest),
        "restored": restored,
        "replayed": replayed,
    }


def main(out: Path) -> None:
    for name in RUNS:  # one process group for all (Fabric keeps the one it finds)
        result = _run(out, name)
        if int(os.environ["RANK"]) == 0:
            (out / f"{name}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("fabric")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "tests.integration.test_lightning_fabric", str(out)]
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out


@pytest.mark.parametrize("name", list(RUNS))
def test_fabric_matches_one_device_and_resumes(runs, tmp_path, name):
    from nnscaler.integration.lightning.fabric import NnScalerFabricStrategy

    result = json.loads((runs / f"{name}.json").read_text())
    assert result["step"] == STEPS - 1 and result["rest"] == []
    assert result["restored"] and result["replayed"], result
    merged_file = tmp_path / "merged.pt"
    NnScalerFabricStrategy.merge_checkpoint(runs / f"{name}.ckpt", merged_file)
    merged = torch.load(merged_file, weights_only=False)
    assert merged["step"] == STEPS
    want = reference_weights(STEPS, 2 // RUNS[name][1])
    assert set(merged["model"]) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(merged["model"][k], v, rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")
    plain = Regressor()
    plain.load_state_dict(merged["model"])  # strict: the single-device module's own names


def test_fabric_strategy_arguments_are_checked():
    from nnscaler import ComputeConfig
    from nnscaler.integration.lightning.fabric import NnScalerFabricStrategy

    with pytest.raises(ConfigError, match="compute_config"):
        NnScalerFabricStrategy(pas_policy="dp")
    with pytest.raises(ConfigError, match="use_end2end=True"):
        NnScalerFabricStrategy(compute_config=ComputeConfig(2, 2, use_end2end=True), pas_policy="pp")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
