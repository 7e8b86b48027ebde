"""Robust gradient aggregation (ComputeConfig.grad_aggregation, docs/faulty_replicas.md) against a
single-process reference of each rule applied to the replicas' gradients, on real gloo ranks: dp only
(4 ranks, with and without a sign-flipping replica) and tp 2 x dp (4 ranks for zeno, whose n > b allows
2 replicas; 6 ranks for median / trimmed_mean, which need n > 2b), without ZeRO and under ZeRO 1 and 2.
Also: the rules themselves, the refusals (bad mode, too few replicas, ZeRO-3, several ZeRO groups,
hierarchical all-reduce, pipeline stages), the fault-injection variable, and the per-step records."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn

from nnscaler.config import ComputeConfig
from nnscaler.errors import ConfigError
from nnscaler.runtime import build_optimizer
from nnscaler.runtime.grads.fault_inject import FAULT_ENV, from_env
from nnscaler.runtime.grads.robust import coordinate_rule
from nnscaler.runtime.grads.zeno import zeno_keep
from tests.dist_util import spawn
from tests.runtime.test_module import BATCH, Gen, Ref, _setup
from tests.runtime.test_reducer import TINY_MB, _params_match, _rows

GAMMA, RHO, LR = 0.05, 1e-3, 0.1
FLIP = "rank=3,kind=sign_flip,scale=10,every=1"


# ---- the single-process reference -------------------------------------------------------------------


def _replica_grads(ref: Ref, x: torch.Tensor, t: torch.Tensor, world: int, plan: int) -> list[dict[str, Any]]:
    out = []
    for d in range(world // plan):
        ref.zero_grad()
        rows = _rows(d * plan, world, plan)
        ref(x[rows], t[rows]).backward()
        out.append({n: p.grad.detach().clone() for n, p in ref.named_parameters()})
    ref.zero_grad()
    return out


def _zeno_scores(ref: Ref, grads: list[dict[str, Any]], xv: torch.Tensor, tv: torch.Tensor) -> list[float]:
    params = dict(ref.named_parameters())
    scores = []
    with torch.no_grad():
        before = float(ref(xv, tv))
        for g in grads:
            moved = {n: params[n] - GAMMA * g[n] for n in params}
            after = float(torch.func.functional_call(ref, moved, (xv, tv), tie_weights=True))
            sq = sum(float(v.square().sum()) for v in g.values())
            scores.append(before - after - RHO * sq)
    return scores


def reference_rule(
    grads: list[dict[str, Any]], mode: str, b: int, scores: list[float] | None
) -> dict[str, Any]:
    """The rule by its definition, on whole (unsharded) per-replica gradients."""
    n, out = len(grads), {}
    for name in grads[0]:
        stacked = torch.stack([g[name] for g in grads])
        if mode == "zeno":
            best = sorted(range(n), key=lambda k: -scores[k])[: n - b]
            out[name] = stacked[best].mean(0)
            continue
        ordered = stacked.sort(dim=0).values
        lo, hi = ((n - 1) // 2, n // 2 + 1) if mode == "median" else (b, n - b)
        out[name] = ordered[lo:hi].mean(0)
    return out


# ---- the parallel side -------------------------------------------------------------------------------


def _one_case(rank: int, world: int, plan: int, mode: str, b: int, stage: int, fault: str | None) -> None:
    what = f"{mode} b={b} plan={plan} world={world} zero_stage={stage} fault={fault}"
    os.environ.pop(FAULT_ENV, None)
    if fault:
        os.environ[FAULT_ENV] = fault
    ref, full, x, t = _setup()
    gen = torch.Generator().manual_seed(7)
    xv, tv = torch.randn(BATCH, x.shape[1], generator=gen), torch.randn(BATCH, t.shape[1], generator=gen)
    cfg = ComputeConfig(
        plan,
        world,
        grad_aggregation=mode,
        byzantine_b=b,
        use_zero=stage > 0,
        zero_stage=max(stage, 1),
        reducer_bucket_cap_mb=TINY_MB,
        **({"zeno_gamma": GAMMA, "zeno_rho": RHO} if mode == "zeno" else {}),  # read only by zeno
    )
    pm = Gen(rank, world, plan, init_params=False)
    pm.compute_config = cfg
    pm.load_merged_state_dict(full)
    if mode == "zeno":
        pm.set_zeno_batch({"x": xv, "t": tv})
    opt = build_optimizer(pm, torch.optim.SGD, lr=LR)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(2):
        grads = _replica_grads(ref, x, t, world, plan)
        if fault:  # rank 3 (plan 1) is replica 3, whole: its gradient is sent as -10 g
            grads[3] = {k: -10 * v for k, v in grads[3].items()}
        scores = _zeno_scores(ref, grads, xv, tv) if mode == "zeno" else None
        want = reference_rule(grads, mode, b, scores)
        pm(x[_rows(rank, world, plan)], t[_rows(rank, world, plan)]).backward()
        opt.step()
        opt.zero_grad()
        for n, p in ref.named_parameters():
            p.grad = want[n]
        ref_opt.step()
        _params_match(pm, ref, f"{what}: parameters after step {step}")
        stats = pm.aggregation_stats
        assert stats is not None and stats.steps == step + 1, what
        if mode == "zeno":
            assert stats.last_scores == pytest.approx(scores, rel=1e-4, abs=1e-6), what
        if fault:
            assert stats.last_dropped == [3], f"{what}: dropped {stats.last_dropped}"
    os.environ.pop(FAULT_ENV, None)


def cases_worker(rank: int, world: int, cases: list[tuple[Any, ...]]) -> None:
    for case in cases:
        _one_case(rank, world, *case)


DP_CASES = [  # plan, mode, b, zero stage, fault
    (1, "median", 1, 0, None),
    (1, "median", 1, 0, FLIP),
    (1, "trimmed_mean", 1, 1, FLIP),
    (1, "trimmed_mean", 1, 2, None),
    (1, "median", 1, 2, FLIP),
    (1, "zeno", 1, 0, FLIP),
    (1, "zeno", 2, 1, None),
    (1, "zeno", 1, 2, FLIP),
    (2, "zeno", 1, 0, None),
    (2, "zeno", 1, 2, None),
]
TP6_CASES = [
    (2, "median", 1, 0, None),
    (2, "trimmed_mean", 1, 1, None),
    (2, "median", 1, 2, None),
]


def test_robust_rules_match_the_reference_on_4_ranks(tmp_path) -> None:
    spawn(cases_worker, 4, tmp_path, DP_CASES, timeout=200)


def test_robust_rules_per_tensor_parallel_shard_on_6_ranks(tmp_path) -> None:
    spawn(cases_worker, 6, tmp_path, TP6_CASES, timeout=200)


# ---- pure pieces -----------------------------------------------------------------------------------------


def test_coordinate_rules_trim_outliers_and_nan() -> None:
    values = torch.tensor([[1.0, float("nan")], [3.0, 2.0], [2.0, -1.0], [100.0, 5.0]])
    med, outside = coordinate_rule(values, "median", 1)
    assert torch.equal(med, torch.tensor([2.5, 3.5]))
    assert outside.tolist() == [2, 0, 1, 1]  # per coordinate the smallest and the largest (NaN) are left out
    trimmed, _ = coordinate_rule(values[:, :1], "trimmed_mean", 1)
    assert torch.equal(trimmed, torch.tensor([2.5]))
    odd, _ = coordinate_rule(torch.tensor([[5.0], [1.0], [9.0]]), "median", 1)
    assert odd.tolist() == [5.0]
    with pytest.raises(ValueError, match="more than 4"):
        coordinate_rule(values, "trimmed_mean", 2)


def test_zeno_keeps_the_best_scores_and_drops_nan() -> None:
    assert zeno_keep([0.3, float("nan"), 0.1, 0.2], 1) == [True, False, True, True]
    assert zeno_keep([0.3, -5.0, 0.1, 0.2], 2) == [True, False, False, True]
    assert zeno_keep([0.1, 0.1, 0.1], 1) == [True, True, False]  # ties: the lower index


def test_bad_configs_are_refused_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="grad_aggregation must be one of"):
        ComputeConfig(1, 4, grad_aggregation="krum")
    with pytest.raises(ConfigError, match=r"needs at least 5 .* \(n > 2b\)"):
        ComputeConfig(1, 4, grad_aggregation="trimmed_mean", byzantine_b=2)
    with pytest.raises(ConfigError, match=r"needs at least 3 .* \(n > 2b\)"):
        ComputeConfig(2, 4, grad_aggregation="median")
    with pytest.raises(ConfigError, match=r"needs at least 5 .* \(n > b\)"):
        ComputeConfig(1, 4, grad_aggregation="zeno", byzantine_b=4)
    ComputeConfig(1, 4, grad_aggregation="zeno", byzantine_b=3)
    ComputeConfig(1, 2, grad_aggregation="median", byzantine_b=0)  # b = 0: the mean
    with pytest.raises(ConfigError, match="byzantine_b must be an int >= 0"):
        ComputeConfig(1, 4, grad_aggregation="median", byzantine_b=-1)
    with pytest.raises(ConfigError, match="zeno_gamma must be > 0"):
        ComputeConfig(1, 4, grad_aggregation="zeno", zeno_gamma=0.0)
    with pytest.raises(ConfigError, match="ZeRO stage 3"):
        ComputeConfig(1, 4, grad_aggregation="median", use_zero=True, zero_stage=3)
    with pytest.raises(ConfigError, match="zero_ngroups > 1"):
        ComputeConfig(1, 8, grad_aggregation="median", use_zero=True, zero_ngroups=2)
    with pytest.raises(ConfigError, match="hierarchical_allreduce=True"):
        ComputeConfig(1, 4, grad_aggregation="zeno", hierarchical_allreduce=True)


def test_fault_injection_is_inert_unless_set_and_checks_its_spec() -> None:
    assert from_env(3, {}) is None
    assert from_env(2, {FAULT_ENV: FLIP}) is None
    inj = from_env(3, {FAULT_ENV: FLIP})
    assert inj is not None and (inj.kind, inj.scale, inj.every) == ("sign_flip", 10.0, 1)
    for bad in ("rank=3", "rank=3,kind=melt", "rank=x,kind=nan", "rank=3,kind=nan,often=2", "kind"):
        with pytest.raises(ConfigError, match=FAULT_ENV):
            from_env(3, {FAULT_ENV: bad})
    g = torch.ones(4)
    stuck = from_env(0, {FAULT_ENV: "rank=0+1,kind=stuck,every=2"})
    assert stuck is not None and from_env(1, {FAULT_ENV: "rank=0+1,kind=stuck"}) is not None
    stuck.corrupt(0, g, 0)
    g2 = torch.full((4,), 5.0)
    stuck.corrupt(0, g2, 1)  # not its round: left alone
    assert g2.tolist() == [5.0] * 4
    stuck.corrupt(0, g2, 2)
    assert g2.tolist() == [1.0] * 4  # the gradient of the first corrupted round, again


# ---- pipelines are refused --------------------------------------------------------------------------------


class StagedGen(Gen):
    use_scheduler = True  # what the compiler sets on a pipeline stage's module


def pipeline_worker(rank: int, world: int) -> str:
    ref, full, x, t = _setup()
    pm = StagedGen(rank, world, 1, init_params=False)
    pm.compute_config = ComputeConfig(1, world, grad_aggregation="median", byzantine_b=0)
    with pytest.raises(ConfigError, match="not supported with pipeline stages") as err:
        pm.reducer  # noqa: B018 (the reducer is built on first use)
    return str(err.value)


def test_pipeline_stages_are_refused(tmp_path) -> None:
    msgs = spawn(pipeline_worker, 2, tmp_path, timeout=60)
    assert all("grad_aggregation='median'" in m for m in msgs)


def _unused(ref: nn.Module) -> None:  # keep Ref imported for readers: the single-device model
    del ref
