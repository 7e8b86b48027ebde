"""Pipeline runtime: activation memory of the schedules, counted on the first stage: under 1F1B at most `nstages`
micro-batches keep activations for backward at once, under GPipe all of them.

The count comes from autograd itself: every tensor saved for backward during stage 0's forward of
micro-batch m is packed into a holder tagged m (torch.autograd.graph.saved_tensors_hooks); a holder
dies when autograd frees it after that backward. A micro-batch is alive while any holder is.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from tests import zoo
from tests.dist_util import spawn

NSTAGES = 4
NMICROS = 8


class _Holder:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _count_alive(rank: int, world_size: int, scheduler: str, gen_savedir: str) -> dict:
    import nnscaler
    from nnscaler import ComputeConfig, parallelize

    nnscaler.init()
    model, make_batch = zoo.build("gpt_deep", seed=0)
    pas = {"pipeline_nmicros": NMICROS, "pipeline_scheduler": scheduler}
    cfg = ComputeConfig(NSTAGES, world_size, use_end2end=True, pas_config=pas)
    pm = parallelize(model, make_batch(1, 2), "pp", cfg, gen_savedir=gen_savedir)
    samples = [make_batch(10 + m, 2) for m in range(NMICROS)]
    if rank != 0:
        pm.train_step(samples)
        return {}

    alive: dict[int, int] = {}
    peak = {"micro_batches": 0}
    current = {"micro": -1}
    stage0 = pm.stage0

    def counted_stage0(*args, **kwargs):
        current["micro"] += 1  # stage 0 runs its forwards in micro-batch order
        return stage0(*args, **kwargs)

    def freed(micro: int) -> None:
        alive[micro] -= 1

    def pack(t: torch.Tensor) -> _Holder:
        holder = _Holder(t)
        m = current["micro"]
        alive[m] = alive.get(m, 0) + 1
        weakref.finalize(holder, freed, m)
        peak["micro_batches"] = max(peak["micro_batches"], sum(1 for n in alive.values() if n > 0))
        return holder

    pm.stage0 = counted_stage0
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.tensor):
        pm.train_step(samples)
    return {"peak": peak["micro_batches"], "left": sum(alive.values()), "forwards": current["micro"] + 1}


@pytest.mark.parametrize("scheduler,expected", [("1f1b", NSTAGES), ("gpipe", NMICROS)])
def test_live_micro_batches_on_first_stage(scheduler, expected, tmp_path):
    results = spawn(_count_alive, NSTAGES, tmp_path, scheduler, str(tmp_path / "gen"))
    first = results[0]
    assert first["forwards"] == NMICROS
    assert first["left"] == 0, f"{scheduler}: {first['left']} saved tensors outlived the train step"
    if scheduler == "1f1b":
        assert first["peak"] <= NSTAGES, f"1F1B kept {first['peak']} micro-batches alive on stage 0"
        assert first["peak"] == expected
    else:
        assert first["peak"] == NMICROS, f"GPipe kept {first['peak']} micro-batches alive, expected all"


def _infer_and_check(rank: int, world_size: int, gen_savedir: str) -> dict:
    import nnscaler
    from nnscaler import ComputeConfig, parallelize

    nnscaler.init()
    model, make_batch = zoo.build("gpt_deep", seed=0)
    cfg = ComputeConfig(2, world_size, use_end2end=True, pas_config={"pipeline_nmicros": 2})
    pm = parallelize(model, make_batch(1, 2), "pp", cfg, gen_savedir=gen_savedir)
    samples = [make_batch(20 + m, 2) for m in range(2)]
    errors = {}
    try:
        pm.train_step(samples[:1])
    except ValueError as e:
        errors["count"] = str(e)
    try:
        pm(**samples[0])
    except RuntimeError as e:
        errors["forward"] = str(e)
    inferred = [float(x) for x in pm.infer_step(samples)]
    # one batch of 4 rows is split into the schedule's 2 micro-batches
    whole = {k: torch.cat([s[k] for s in samples]) for k in samples[0]}
    trained = [float(x) for x in pm.train_step(whole)]
    grads = sum(p.grad is not None for p in pm.parameters())
    return {"inferred": inferred, "trained": trained, "errors": errors, "grads": grads}


def test_infer_step_and_bad_calls(tmp_path):
    """Every rank gets the losses; infer_step matches train_step and the single-device model."""
    results = spawn(_infer_and_check, 4, tmp_path, str(tmp_path / "gen"))
    model, make_batch = zoo.build("gpt_deep", seed=0)
    with torch.no_grad():
        expected = [float(model(**make_batch(20 + m, 2))) for m in range(2)]
    for r in results:
        assert r["inferred"] == pytest.approx(expected, rel=1e-5)
        assert r["trained"] == pytest.approx(expected, rel=1e-5)
        assert r["grads"] > 0
        assert (
            "got 1 micro-batches" in r["errors"]["count"] and "pipeline_nmicros']=2" in r["errors"]["count"]
        )
        assert "train_step(samples)" in r["errors"]["forward"]
