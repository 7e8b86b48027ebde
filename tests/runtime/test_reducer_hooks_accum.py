"""The optimizer's reducer hooks under gradient accumulation (nnScaler 0.8's test): two backward()
calls per optimizer.step() without no_sync, with the async reducer (our default). Every hook runs once
per bucket per step, on the accumulated gradient (pre: this rank's part, post: the reduced one), and
the parameters after SGD steps match the same run without hooks (and equal exactly those of the sync
reducer, nnScaler 0.8's default, which also reduces the accumulated sum once). Two parallelized
modules inside a plain module with an extra nn.Linear (the optimizer's outer reducer), on 2 and 4
gloo ranks, with ZeRO 1 / 2 / 3 and the pipeline's train_step."""

from __future__ import annotations

import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import nnscaler
from nnscaler import ComputeConfig, parallelize
from tests.dist_util import spawn

STEPS = 2
UPDATE_FREQ = 2
TINY_MB = 0.0002
"""Bucket cap: a few parameters per bucket, so reducers have several buckets."""


class FcRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)
        self.fc3 = nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x))))))


class Outer(nn.Module):
    def __init__(self, a: nn.Module, b: nn.Module) -> None:
        super().__init__()
        self.fc_relu1, self.fc_relu2 = a, b
        self.linear3 = nn.Linear(4, 1)

    def forward(self, x):
        return torch.sigmoid(self.linear3(self.fc_relu2(self.fc_relu1(x))))


def _model(policy: str, cfg: ComputeConfig, gen: str) -> nn.Module:
    torch.manual_seed(0)
    dummy = {"x": torch.tensor([[1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0]])}
    a = parallelize(FcRelu(), dummy, policy, cfg, gen_savedir=gen, instance_name="fc_relu1")
    b = parallelize(FcRelu(), dummy, policy, cfg, gen_savedir=gen, instance_name="fc_relu2")
    return Outer(a, b)


def _reducers(model: nn.Module, opt: Any) -> list[Any]:
    out = [r for m in model.modules() if isinstance(m, nnscaler.ParallelModule) for r in m.reducers]
    return out + ([opt._non_parallel_module_reducer] if opt._non_parallel_module_reducer else [])


def _train(model: nn.Module, replica: int, hooks: bool) -> dict[str, Any]:
    """Train with the optimizer's reducer hooks (`hooks`) recording every call, or without."""
    opt = nnscaler.build_optimizer(model, torch.optim.SGD, lr=0.5)
    reducers = _reducers(model, opt)
    pre: dict[int, list[torch.Tensor]] = defaultdict(list)
    post: dict[int, list[torch.Tensor]] = defaultdict(list)
    if hooks:
        opt.register_reducer_pre_hook(lambda r, g: pre[reducers.index(r)].append(g.clone()))
        opt.register_reducer_post_hook(lambda r, g: post[reducers.index(r)].append(g.clone()))
    with warnings.catch_warnings(record=True) as seen:  # the reducers warn in their first backward
        warnings.simplefilter("always")
        res = _steps(model, opt, reducers, replica, pre, post)
    res["warnings"] = [str(w.message) for w in seen if "reducer hooks are registered" in str(w.message)]
    return res


def _steps(
    model: nn.Module, opt: Any, reducers: list[Any], replica: int, pre: dict, post: dict
) -> dict[str, Any]:
    """STEPS steps of UPDATE_FREQ backwards each (no no_sync); hook calls per reducer after each step."""
    gen = torch.Generator().manual_seed(100 + replica)
    counts, sums_ok, post_ok = [], [], []
    for i in range(STEPS * UPDATE_FREQ):
        x, y = torch.randn(2, 4, generator=gen), torch.rand(2, 1, generator=gen)
        nn.functional.binary_cross_entropy(model(x), y).backward()
        if i % UPDATE_FREQ == UPDATE_FREQ - 1:
            opt.step()
            counts.append({k: (len(pre[k]), len(post[k])) for k in range(len(reducers))})
            sums_ok.append(_pre_sums_to_post(reducers, pre, post))
            post_ok.append(_post_is_grad(reducers, post))
            opt.zero_grad()
            pre.clear(), post.clear()
    nbuckets = [len(getattr(r, "buckets", [None])) for r in reducers]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {"counts": counts, "nbuckets": nbuckets, "params": params, "sums": sums_ok, "post": post_ok}


def _pre_sums_to_post(reducers: list[Any], pre: dict, post: dict) -> bool:
    """Each all-reduced bucket: the pre-hook gradients of the replicas sum to the post-hook one."""
    ok = True
    for k, r in enumerate(reducers):
        if getattr(r, "zero", False) or r.group is None:  # ZeRO: the post-hook sees this rank's slice
            continue
        for before, after in zip(pre[k], post[k]):
            total = before.clone()
            dist.all_reduce(total, group=r.group)
            ok = ok and torch.allclose(total, after, rtol=1e-5, atol=1e-7)
    return ok


def _post_is_grad(reducers: list[Any], post: dict) -> bool:
    """The post-hook saw what the step used: each bucket's reduced gradient is its parameters' `.grad`."""
    ok = True
    for k, r in enumerate(reducers):
        if getattr(r, "zero", True):  # ZeRO: slices; the outer reducer: checked by `_pre_sums_to_post`
            continue
        for bucket, got in zip(r.buckets, post[k]):
            want = torch.cat([p.grad.flatten() for p in bucket.params])
            ok = ok and torch.equal(got[: want.numel()], want)
    return ok


def _run(rank: int, world: int, gen: str, policy: str, cfg_kw: dict[str, Any]) -> dict[str, Any]:
    cfg = ComputeConfig(**cfg_kw)
    replica = rank // cfg.plan_ngpus  # the ranks of one plan copy share their batches
    hooked = _train(_model(policy, cfg, gen), replica, hooks=True)
    plain = _train(_model(policy, cfg, gen), replica, hooks=False)
    out = {**hooked, "plain": plain["params"], "sync": None}
    if cfg_kw.get("zero_stage", 1) < 2:  # ZeRO 2 / 3 reduce asynchronously whatever the setting
        sync_cfg = ComputeConfig(**{**cfg_kw, "use_async_reducer": False})  # nnScaler 0.8's reducer
        out["sync"] = _train(_model(policy, sync_cfg, gen + "_sync"), replica, hooks=False)["params"]
    return out


def _check(results: list[dict[str, Any]], pm_reducers: int) -> None:
    for rank, res in enumerate(results):
        assert len(res["nbuckets"]) == pm_reducers + 1  # + the outer nn.Linear's reducer
        for step, counts in enumerate(res["counts"]):  # once per bucket per step, pre and post alike
            want = {k: (n, n) for k, n in enumerate(res["nbuckets"])}
            assert counts == want, (rank, step, counts, want)
        assert all(res["sums"]) and all(res["post"]), (res["sums"], res["post"])
        assert res["params"].keys() == res["plain"].keys()
        # hooks change when gradients are reduced, not what: the same sum, reduced once instead of
        # per backward (float rounding may differ), exactly what the sync reducer (nnScaler 0.8) reduces
        for name, value in res["params"].items():
            torch.testing.assert_close(value, res["plain"][name], rtol=1e-6, atol=1e-7, msg=name)
            if res["sync"] is not None:
                assert torch.equal(value, res["sync"][name]), name
        # one warning per parallel module whose reduction stops overlapping backward, on rank 0 only
        assert len(res["warnings"]) == (pm_reducers if rank == 0 else 0), res["warnings"]
        assert all("no longer overlaps backward" in w and "no_sync" in w for w in res["warnings"])


def test_hooks_once_per_step_dp_2_ranks(tmp_path: Path) -> None:
    kw = {"plan_ngpus": 1, "runtime_ngpus": 2, "reducer_bucket_cap_mb": TINY_MB}
    results = spawn(_run, 2, tmp_path / "run", str(tmp_path / "gen"), "dp", kw)
    assert min(results[0]["nbuckets"][:2]) > 1  # several buckets: each gets its own calls
    _check(results, pm_reducers=2)


CASES_4 = {
    "tp": ("tp", {"plan_ngpus": 2, "runtime_ngpus": 4}),
    "zero1_scatter": (
        "dp",
        {"plan_ngpus": 1, "runtime_ngpus": 4, "use_zero": True, "zero_use_reduce_scatter": True},
    ),
    "zero2": ("dp", {"plan_ngpus": 1, "runtime_ngpus": 4, "use_zero": True, "zero_stage": 2}),
    "zero3": ("dp", {"plan_ngpus": 1, "runtime_ngpus": 4, "use_zero": True, "zero_stage": 3}),
}


@pytest.mark.parametrize("case", list(CASES_4))
def test_hooks_once_per_step_4_ranks(tmp_path: Path, case: str) -> None:
    policy, kw = CASES_4[case]
    results = spawn(_run, 4, tmp_path / "run", str(tmp_path / "gen"), policy, kw)
    _check(results, pm_reducers=2)


class Chain(nn.Module):
    """Returns its loss; no repeated layers, so `pp` splits it evenly over two stages."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).pow(2).mean()


def _pp_train(rank: int, cfg: ComputeConfig, gen: str, hooks: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rank 0 plans: "operators evenly"
        pm = parallelize(Chain(), {"x": torch.ones(2, 4)}, "pp", cfg, gen_savedir=gen)
    opt = nnscaler.build_optimizer(pm, torch.optim.SGD, lr=0.5)
    (red,) = pm.reducers
    calls: dict[str, list[bool]] = {"pre": [], "post": []}
    if hooks:  # pre: whether train_step's last micro-batch launched it (in backward, overlapping)
        opt.register_reducer_pre_hook(lambda r, g: calls["pre"].append(r.last_backward))
        opt.register_reducer_post_hook(lambda r, g: calls["post"].append(r.last_backward))
    gen_x = torch.Generator().manual_seed(100 + rank // cfg.plan_ngpus)
    per_step = []
    for _ in range(STEPS):
        pm.train_step([{"x": torch.randn(2, 4, generator=gen_x)} for _ in range(2)])
        opt.step()
        opt.zero_grad()
        per_step.append({k: list(v) for k, v in calls.items()})
        calls["pre"].clear(), calls["post"].clear()
    params = {n: p.detach().clone() for n, p in pm.named_parameters()}
    return {"calls": per_step, "nbuckets": len(red.buckets), "params": params}


def _pp_run(rank: int, world: int, gen: str) -> dict[str, Any]:
    cfg = ComputeConfig(
        2, world, use_end2end=True, pas_config={"pipeline_nmicros": 2}, reducer_bucket_cap_mb=TINY_MB / 4
    )
    hooked = _pp_train(rank, cfg, gen, hooks=True)
    return {**hooked, "plain": _pp_train(rank, cfg, gen, hooks=False)["params"]}


def test_pipeline_train_step_hooks_once_per_step_and_overlapping(tmp_path: Path) -> None:
    """train_step (no_sync, then the last micro-batch's backward launches the buckets): with hooks the
    last micro-batch still launches them, so each bucket's hooks run once per step, in backward."""
    results = spawn(_pp_run, 4, tmp_path / "run", str(tmp_path / "gen"))
    for rank, res in enumerate(results):
        assert res["nbuckets"] > 1
        for calls in res["calls"]:
            assert calls["pre"] == [True] * res["nbuckets"], (rank, calls)
            assert len(calls["post"]) == res["nbuckets"], (rank, calls)
        for name, value in res["params"].items():
            torch.testing.assert_close(value, res["plain"][name], rtol=0, atol=0, msg=name)
