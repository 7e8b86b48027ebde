"""Expert parallelism with data-parallel replicas under every gradient reducer: ep 2 inside a plan of 2
devices, 4 ranks (replicas {0, 1} and {2, 3}). Rank r holds experts of half r % 2, so an expert
weight's gradient must be reduced over the ranks holding the same experts ({0, 2} or {1, 3}), never
over all 4; non-expert weights are summed over the ep axis in the graph, then over the same replicas.

- parity (tests/parity.py, SGD, which sees a gradient's scale): ZeRO 1, ZeRO 2 and the overlapped
  (async) reducer with small buckets (launches inside backward), Mixtral and DeepSeek-V3;
- the reducer itself: every expert parameter's all-reduce group and ZeRO group are its replica group,
  and after one step the expert gradients agree within it and differ across it.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_util import spawn
from tests.parity import ParityCase, run_parity_many

M = "tests.models_moe:"
EP = {"pas_config": {"ep_size": 2}}
REDUCERS = {
    "zero1": {"use_zero": True, "zero_stage": 1, "use_async_reducer": False},
    "zero2": {"use_zero": True, "zero_stage": 2},
    "async": {"use_async_reducer": True, "reducer_bucket_cap_mb": 0.01},
}
"""ComputeConfig options of each reducer checked (ZeRO 2 always overlaps its reduce-scatters)."""


@pytest.mark.timeout(600)
def test_ep2_with_replicas_under_zero_and_async_reducer(tmp_path):
    cases = [
        ParityCase(M + model, "tp", 2, {**EP, **options}, optimizer="sgd")
        for model in ("build_mixtral", "build_deepseek_v3")
        for options in REDUCERS.values()
    ]
    run_parity_many(cases, 4, tmp_path=tmp_path, timeout=550)


def _expert_groups(rank: int, world: int, root: str) -> dict[str, dict]:
    """Per reducer: the ranks of the groups reducing each expert parameter, and its gradient."""
    import nnscaler
    from nnscaler import ComputeConfig, build_optimizer, parallelize
    from tests import zoo
    from tests.models_moe import build_mixtral

    nnscaler.init()
    out = {}
    for name, options in REDUCERS.items():
        model, make_batch = build_mixtral(seed=0)
        cfg = ComputeConfig(2, world, **EP, **options)
        pm = parallelize(model, make_batch(1, 4), "tp", cfg, gen_savedir=f"{root}/{name}")
        opt = build_optimizer(pm, torch.optim.SGD, lr=0.1)
        zoo.extract_loss(pm(**make_batch(10 + rank // 2, 4))).backward()
        pm.sync_grad()
        red = pm.reducer
        names = pm.dist_param_map
        experts = {names[n]: p for n, p in pm.named_parameters() if ".experts." in names[n]}
        in_reducer = {id(p) for p in red.params}
        found = {}
        for full, p in experts.items():
            info = next(i for i in pm.fullmap.values() if i.original_name == full)
            groups = [red.group] + ([red.zero_group] if red.zero else [])
            grad = _reduced_grad(red, p)
            found[full] = {
                "reduced": id(p) in in_reducer,
                "groups": [dist.get_process_group_ranks(g) for g in groups],
                "shard": str(info.shard),
                "grad": grad,
            }
        out[name] = found
        opt.zero_grad()
    return out


def _reduced_grad(red, p: torch.nn.Parameter) -> torch.Tensor:
    """The reduced gradient of `p` this rank holds, flat: all of it (all-reduce), or under reduce-scatter
    its ZeRO slice in place and zeros elsewhere (so the slices of a ZeRO group add up to the whole)."""
    if not red.scatter:
        return p.grad.detach().reshape(-1).clone()
    flat = torch.zeros(p.numel(), dtype=p.dtype)
    for piece in red.pieces:
        if piece.source is p:
            flat[piece.start : piece.end] = piece.grad().detach().cpu()
    return flat


@pytest.mark.timeout(400)
def test_expert_gradients_are_reduced_over_their_replica_group_only(tmp_path):
    """Groups: each expert parameter's all-reduce and ZeRO groups are its replica group. Values: after one
    step from the same weights and batches, every reducer gives rank r the same expert gradient, which
    ranks r and r + 2 share (ZeRO 2: their slices add up to it) and rank r + 1 does not."""
    results = spawn(_expert_groups, 4, tmp_path, str(tmp_path / "gen"), timeout=360)
    for reducer in REDUCERS:
        experts = results[0][reducer]
        assert experts, f"{reducer}: rank 0 holds no expert parameter (no '.experts.' in any name)"
        for full in experts:
            for rank in range(4):
                got = results[rank][reducer][full]
                replicas = [rank % 2, rank % 2 + 2]
                assert got["reduced"], f"{reducer}: rank {rank}'s {full} is not in its reducer"
                assert got["groups"] and all(g == replicas for g in got["groups"]), (
                    f"{reducer}: rank {rank} reduces {full} ({got['shard']}) over {got['groups']}; "
                    f"expected its replica group {replicas} (the ranks holding the same experts)"
                )
            shards = [results[r][reducer][full]["shard"] for r in range(4)]
            assert shards[0] == shards[2] != shards[1] == shards[3], (
                f"{reducer}: {full} shards by rank {shards}; expected the experts split over ep (ranks 0, 1) "
                "and replicated over the replicas (ranks 0, 2)"
            )
            grads = [results[r][reducer][full]["grad"] for r in range(4)]
            reference = [results[r]["async"][full]["grad"] for r in range(2)]
            for half in (0, 1):
                held = grads[half] + grads[half + 2] if reducer == "zero2" else grads[half]
                if reducer != "zero2":
                    torch.testing.assert_close(
                        grads[half + 2], held, msg=f"{reducer}: {full} rank {half} vs +2"
                    )
                torch.testing.assert_close(
                    held, reference[half], msg=f"{reducer}: {full} half {half} vs async"
                )
            assert not torch.equal(reference[0], reference[1]), (
                f"ranks 0 and 1 hold the same {full} gradient; they hold different experts"
            )
