"""nnScaler 0.8 compatibility on two gloo ranks: the optimizer's reducer hooks, broadcast strategy
'none' on a rank without the files (ModuleNotFoundError there, and no hang on the others), and `pp`
without pivots training like one process."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import nnscaler
from nnscaler import ComputeConfig, parallelize
from tests.dist_util import spawn


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class FlatLoss(nn.Module):
    """No repeated layers: `pp` splits its operators evenly."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).pow(2).mean()


def _batch(rank: int) -> torch.Tensor:
    return torch.arange(8.0).reshape(2, 4) / 8 + rank


class Wrapped(nn.Module):
    """A parallel module and a head outside it (its gradients go through the optimizer's OuterReducer)."""

    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.body(x))


def _hooks(rank, world_size, tmp):
    torch.manual_seed(0)
    body = parallelize(Net(), {"x": _batch(0)}, "dp", ComputeConfig(1, world_size), gen_savedir=tmp)
    model = Wrapped(body)
    opt = nnscaler.build_optimizer(model, torch.optim.SGD, lr=0.0)
    reducers = [*body.reducers, opt._non_parallel_module_reducer]
    calls = {"pre": [], "post": []}
    opt.register_reducer_pre_hook(lambda red, g: (calls["pre"].append(reducers.index(red)), g.mul_(2.0)))
    opt.register_reducer_post_hook(lambda red, g: calls["post"].append((reducers.index(red), g.clone())))
    out = {}
    for step in range(2):
        model(_batch(rank)).sum().backward()
        opt.step()
        out[step] = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt.zero_grad()
    # the same gradient without hooks: the mean over the ranks
    ref = Wrapped(Net())
    merged = nnscaler.merge_state_dicts([body.state_dict()])[0]
    ref.load_state_dict(
        {
            **{f"body.{k}": v for k, v in merged.items()},
            **{f"head.{k}": v for k, v in model.head.state_dict().items()},
        }
    )
    grads = []
    for r in range(world_size):
        ref.zero_grad()
        ref(_batch(r)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in ref.named_parameters()})
    mean = {n: sum(g[n] for g in grads) / world_size for n in grads[0]}
    names = {f"body.{n}": f"body.{body.fullmap[n].original_name}" for n, _ in body.named_parameters()}
    return {
        "pre": calls["pre"],
        "post": [i for i, _ in calls["post"]],
        "post_head": [g for i, g in calls["post"] if i == 1][-1],
        "grads": {names.get(n, n): g for n, g in out[1].items()},
        "mean": mean,
    }


def test_reducer_hooks_run_before_and_after_each_reduction(tmp_path):
    results = spawn(_hooks, 2, tmp_path / "run", str(tmp_path / "gen"))
    for res in results:
        # per step: the parallel module's reducer (one call per bucket) and the outer reducer (once)
        inner = res["pre"].count(0) // 2
        assert inner >= 1 and sorted(res["pre"]) == [0] * 2 * inner + [1] * 2, res["pre"]
        assert sorted(res["post"]) == sorted(res["pre"])
        assert set(res["grads"]) == set(res["mean"]) and len(res["mean"]) == 6
        for name, grad in res["grads"].items():  # the pre-hook doubled every contribution
            torch.testing.assert_close(grad, 2 * res["mean"][name])
        head = torch.cat([res["grads"]["head.weight"].flatten(), res["grads"]["head.bias"]])
        torch.testing.assert_close(res["post_head"], head)  # post hooks see the reduced gradient


def _no_files(rank, world_size, tmp):
    os.environ["LOCAL_RANK"] = "0"  # each rank its own machine and disk
    try:
        parallelize(
            Net(),
            {"x": _batch(0)},
            "dp",
            ComputeConfig(1, world_size),
            gen_savedir=Path(tmp) / f"rank{rank}",
            broadcast_strategy="none",
        )
    except (ModuleNotFoundError, nnscaler.ConfigError) as err:
        return f"{type(err).__name__}: {err}"
    return "loaded"


def test_broadcast_none_on_a_rank_without_the_files_raises_module_not_found(tmp_path):
    results = spawn(_no_files, 2, tmp_path / "run", str(tmp_path / "gen"))
    assert results[1].startswith("ModuleNotFoundError") and "broadcast_strategy='code'" in results[1]
    # rank 0 has its files but raises too, instead of waiting for rank 1 in the module's process groups
    assert results[0].startswith("ConfigError: ranks [1] do not find their generated code"), results[0]


def _pp_flat(rank, world_size, tmp):
    torch.manual_seed(0)
    model = FlatLoss()
    ref = FlatLoss()
    ref.load_state_dict(model.state_dict())
    cfg = ComputeConfig(2, 2, use_end2end=True, pas_config={"pipeline_nmicros": 2})
    planning = pytest.warns(UserWarning, match="operators evenly") if rank == 0 else contextlib.nullcontext()
    with planning:  # rank 0 plans
        pm = parallelize(model, {"x": _batch(0)}, "pp", cfg, gen_savedir=tmp)
    opt = nnscaler.build_optimizer(pm, torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for step in range(2):
        micro = [_batch(step), _batch(step + 1)]
        out = pm.train_step([{"x": m} for m in micro])
        opt.step()
        opt.zero_grad()
        ref_losses = [ref(m) for m in micro]
        sum(ref_losses).backward()  # train_step sums the micro-batches' gradients (nnScaler's rule)
        ref_loss = sum(ref_losses) / 2
        ref_opt.step()
        ref_opt.zero_grad()
        losses.append((out, ref_loss.item()))
    return losses


def test_pp_without_pivots_trains_like_one_process(tmp_path):
    results = spawn(_pp_flat, 2, tmp_path / "run", str(tmp_path / "gen"))
    for out, want in results[1]:  # the last stage holds the loss
        got = sum(float(v) for v in out) / len(out) if isinstance(out, (list, tuple)) else float(out)
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)


def _tp_weights(rank, world_size, tmp):
    torch.manual_seed(0)
    model = Net()
    pm = parallelize(model, {"x": _batch(0)}, "tp", ComputeConfig(2, 2), gen_savedir=tmp)
    local = {n: p.detach().clone() for n, p in pm.named_parameters()}  # local names, no metadata
    return local, pm.fullmap, pm.dist_param_map, model.state_dict()


def test_merge_partial_states_merges_plain_dicts_by_their_fullmaps(tmp_path):
    results = spawn(_tp_weights, 2, tmp_path / "run", str(tmp_path / "gen"))
    assert any(  # tp split something: the pieces are not whole tensors
        t.shape != results[0][3][info.original_name].shape
        for name, t in results[0][0].items()
        for info in [results[0][1][name]]
    )
    entries = [(local, {"state": {}}, dist_map, fullmap) for local, fullmap, dist_map, _ in results]
    with pytest.warns(UserWarning, match="optimizer state dicts have no nnscaler metadata"):
        merged, opt = nnscaler.ParallelModule.merge_partial_states(entries)
    assert opt is None
    want = results[0][3]
    assert set(merged) == set(want)
    for name, value in want.items():
        torch.testing.assert_close(merged[name], value)
