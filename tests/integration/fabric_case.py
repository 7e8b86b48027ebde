"""The Fabric loop the NnScalerFabricStrategy tests run under torchrun, and their checks: train the
Lightning tests' Regressor for a few SGD steps, save, resume, evaluate, and compare with one device.

A run is `(policy, plan_ngpus, ComputeConfig keywords)`; `main` runs several in one process group
(Fabric keeps the one it finds) and rank 0 writes `<name>.json` and the `<name>.ckpt` directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from nnscaler.errors import ConfigError
from tests.integration.lightning_case import BATCH, LR, SAMPLES, Pairs, Regressor, reference_weights

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
PIPELINE = {"use_end2end": True, "pas_config": {"pipeline_nmicros": 2, "pipeline_nstages": 2}}
"""Two stages, two micro-batches: a call of the model runs the schedule."""

Run = tuple[str, int, dict[str, Any]]


def batch_of(data: Pairs, step: int, replica: int, replicas: int) -> dict[str, torch.Tensor]:
    """What Lightning's DistributedSampler(shuffle=True, seed=0) gives replica `replica` (reference_weights)."""
    perm = torch.randperm(SAMPLES, generator=torch.Generator().manual_seed(0))
    idx = perm[replica::replicas][step * BATCH : (step + 1) * BATCH]
    return {"x": data.x[idx], "y": data.y[idx]}


def _backward_checked(fabric: Any, model: Any, batch: dict[str, torch.Tensor]) -> bool | None:
    """With a pipeline, fabric.backward refuses anything but the loss the model call returned, and Fabric
    refuses a plain `loss.backward()` (which would do nothing); without one, neither is refused."""
    if fabric.strategy.pipelined is None:
        model(**batch).backward()  # allowed, as with Fabric's DDP
        return None
    try:
        fabric.backward(model(**batch) * 2.0)
        return False
    except ConfigError as err:
        if "fabric.backward takes the loss it returned" not in str(err):
            return False
    try:
        model(**batch).backward()
    except RuntimeError as err:
        return "fabric.backward(loss)" in str(err)
    return False


def _run(out: Path, name: str, run: Run, world: int) -> dict:
    import lightning as L

    from nnscaler import ComputeConfig
    from nnscaler.integration.lightning.fabric import NnScalerFabricStrategy

    policy, plan, cfg = run
    strategy = NnScalerFabricStrategy(
        compute_config=ComputeConfig(plan, world, **cfg),
        pas_policy=policy,
        gen_savedir=str(out / "gen" / name),
    )
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=strategy)
    fabric.launch()
    module = Regressor()
    model, opt = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=LR))
    data, replicas, replica = Pairs(), world // plan, fabric.global_rank // plan

    def step(s: int) -> float:
        loss = model(**batch_of(data, s, replica, replicas))
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
    model.eval()
    with torch.no_grad():
        eval_loss = float(model(**batch_of(data, 0, replica, replicas)))
    model.train()
    return {
        "eval_loss": eval_loss,
        "backward_checked": _backward_checked(fabric, model, batch_of(data, 0, replica, replicas)),
        "losses": losses,
        "step": state["step"],
        "rest": sorted(rest),
        "restored": restored,
        "replayed": replayed,
    }


def main(out: Path, runs: dict[str, Run], world: int) -> None:
    for name, run in runs.items():  # one process group for all (Fabric keeps the one it finds)
        result = _run(out, name, run, world)
        if int(os.environ["RANK"]) == 0:
            (out / f"{name}.json").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def launch(module: str, out: Path, world: int, timeout: int = 560) -> Path:
    """`torchrun --nproc_per_node world -m module out`; fails with the processes' output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world)]
    cmd += ["-m", module, str(out)]
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out


def check_run(runs: Path, tmp_path: Path, name: str, run: Run, world: int) -> None:
    """The run resumed exactly, its merged checkpoint is one device's SGD on the replicas' batches and
    loads into the plain module, its evaluation loss is the plain module's, and with a pipeline
    fabric.backward refused a loss other than the call's."""
    from nnscaler.integration.lightning.fabric import NnScalerFabricStrategy

    result = json.loads((runs / f"{name}.json").read_text())
    assert result["step"] == STEPS - 1 and result["rest"] == []
    assert result["restored"] and result["replayed"], result
    merged_file = tmp_path / "merged.pt"
    NnScalerFabricStrategy.merge_checkpoint(runs / f"{name}.ckpt", merged_file)
    merged = torch.load(merged_file, weights_only=False)
    assert merged["step"] == STEPS
    replicas = world // run[1]
    want = reference_weights(STEPS, replicas)
    assert set(merged["model"]) == set(want)
    for k, v in want.items():
        torch.testing.assert_close(merged["model"][k], v, rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")
    plain = Regressor()
    plain.load_state_dict(merged["model"])  # strict: the single-device module's own names
    assert result["backward_checked"] is (True if run[2].get("use_end2end") else None)
    with torch.no_grad():  # rank 0's evaluation batch, on the trained weights
        want_eval = float(plain(**batch_of(Pairs(), 0, 0, replicas)))
    assert abs(result["eval_loss"] - want_eval) < 1e-5, (result["eval_loss"], want_eval)
