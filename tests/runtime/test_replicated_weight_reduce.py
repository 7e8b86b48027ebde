"""Weights held whole where their readers split the batch: the reducer sums their gradients.

Under the `data` policy with plan_ngpus=2 and two data-parallel replicas, every weight is replicated over
the plan's ranks and each rank's gradient is a partial sum. The generated module no longer wraps each
weight in `copy_to_group` (one all-reduce per weight inside backward): it calls `reduce_grad_over`, and
the reducer sums those gradients over the plan's ranks and the replicas in its buckets.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.parity import run_parity


def _gencode(tmp_path: Path, rank: int = 0) -> str:
    (path,) = sorted(Path(tmp_path, "gen").rglob(f"gencode{rank}.py"))
    return path.read_text()


@pytest.mark.parametrize("model_name", ["mlp", "gpt", "tests.test_chunked_loss:build_chunked_lm"])
def test_data_policy_weights_reduced_by_reducer(model_name: str, tmp_path) -> None:
    """SGD parameters match one device (a gradient counted twice or not summed changes them), and the
    generated code reduces no weight inside backward (an activation read whole by split ops, GPT's
    position embedding, keeps its copy_to_group); the chunked loss reads its head weight whole."""
    run_parity(model_name, "data", 2, 4, steps=3, optimizer="sgd", tmp_path=tmp_path)
    src = _gencode(tmp_path)
    assert "copy_to_group(self." not in src
    assert src.count("self.reduce_grad_over(") >= 2
    if model_name == "mlp":  # 1-D plan: the group is the plan's ranks of both replicas, the whole world
        assert 'self.reduce_grad_over("fc1_weight", [0, 1, 2, 3])' in src


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_zero_shards_summed_weights(stage: int, optimizer: str, tmp_path) -> None:
    """ZeRO 1 / 2: the summed weights' buckets are reduce-scattered over their group (the plan's ranks x
    the replicas) and each rank updates its slice; parameters (SGD) and losses (Adam) match one device."""
    cfg = dict(use_zero=True, zero_stage=stage)
    run_parity("gpt", "data", 2, 4, steps=3, optimizer=optimizer, tmp_path=tmp_path, config_kwargs=cfg)
    src = _gencode(tmp_path)
    assert "self.reduce_grad_over(" in src and "copy_to_group(self." not in src


def test_zero3_keeps_copy_to_group(tmp_path) -> None:
    """ZeRO 3 shards over the data-parallel group only: the weights keep their `copy_to_group` (one
    all-reduce each in backward) and still match one device."""
    cfg = dict(use_zero=True, zero_stage=3)
    run_parity("mlp", "data", 2, 4, steps=3, optimizer="sgd", tmp_path=tmp_path, config_kwargs=cfg)
    src = _gencode(tmp_path)
    assert "copy_to_group(self." in src and "reduce_grad_over" not in src


def _zero_slices_and_norm(rank: int, world_size: int, root: str) -> dict[str, float]:
    """The MLP under `data` (2 x 2 replicas) without ZeRO and with ZeRO 2, one Adam step each on the
    same batch: the gradient norms, the merged optimizer states, and how much of the weights this rank's
    ZeRO slices hold."""
    import torch.distributed as dist

    import nnscaler
    from nnscaler import (
        ComputeConfig,
        build_optimizer,
        load_merged_state_dict,
        merge_state_dicts,
        parallelize,
    )
    from tests import zoo

    nnscaler.init()
    out: dict = {}
    for name, options in {"plain": {}, "zero": {"use_zero": True, "zero_stage": 2}}.items():
        model, make_batch = zoo.build("mlp", seed=0)
        cfg = ComputeConfig(2, world_size, **options)
        pm = parallelize(model, make_batch(1, 4), "data", cfg, gen_savedir=f"{root}/{name}")
        opt = build_optimizer(pm, torch.optim.Adam, lr=0.1)
        zoo.extract_loss(pm(**make_batch(2 + rank // 2, 4))).backward()
        out[name] = float(pm.total_gnorm())
        opt.step()
        states: list = [None] * world_size
        dist.all_gather_object(states, (pm.state_dict(), opt.state_dict()))
        model_sd, merged = merge_state_dicts([m for m, _ in states], [o for _, o in states])
        out[f"{name}_adam"] = {i: st["exp_avg_sq"].sum().item() for i, st in merged["state"].items()}
        if name == "zero":
            out["slice"] = sum(pc.end - pc.start for pc in pm.reducer.pieces)
            out["weights"] = sum(p.numel() for p in pm.parameters())
            # load back into a fresh module: each rank takes its slices of the whole states again
            pm2 = parallelize(model, make_batch(1, 4), "data", cfg, gen_savedir=f"{root}/{name}")
            opt2 = build_optimizer(pm2, torch.optim.Adam, lr=0.1)
            load_merged_state_dict(pm2, model_sd, opt2, merged)
            mine, back = opt.state_dict()["state"], opt2.state_dict()["state"]
            out["reloaded"] = bool(mine) and all(
                torch.equal(mine[i]["exp_avg"], back[i]["exp_avg"]) for i in mine
            )
    return out


def test_zero_slices_span_the_group_and_norm_counts_each_once(tmp_path) -> None:
    """Each of the 4 ranks holds a quarter of the (replicated) weights, not a half; the gradient norm
    over the slices equals the one without ZeRO on every rank; the merged optimizer states agree."""
    from tests.dist_util import spawn

    results = spawn(_zero_slices_and_norm, 4, tmp_path, str(tmp_path / "gen"))
    for r in results:
        assert r["slice"] <= r["weights"] / 4 + 4, r
        assert r["zero"] == pytest.approx(r["plain"], rel=1e-5), r
        assert r["plain"] == pytest.approx(results[0]["plain"], rel=1e-6)
    assert sum(r["slice"] for r in results) >= results[0]["weights"]
    # the slices of every rank merge into whole optimizer states, as without ZeRO
    plain, zero = results[0]["plain_adam"], results[0]["zero_adam"]
    assert len(zero) == len(plain) == 6
    assert zero == pytest.approx(plain, rel=1e-5)
    assert all(r["reloaded"] for r in results)


def _count_reductions(rank: int, world_size: int, gen_savedir: str) -> dict[str, int]:
    """One forward, backward and sync_grad of the MLP under `data` (2 x 2 replicas); counts the
    all-reduces backward and sync_grad issue over the whole world (the plan's ranks and the replicas)."""
    import torch.distributed as dist

    import nnscaler
    from nnscaler import ComputeConfig, parallelize
    from tests import zoo

    nnscaler.init()
    model, make_batch = zoo.build("mlp", seed=0)
    pm = parallelize(model, make_batch(1, 4), "data", ComputeConfig(2, world_size), gen_savedir=gen_savedir)
    calls: dict = {"world": 0, "other": 0, "issued": []}
    real = dist.all_reduce

    def counting(tensor, *args, group=None, **kwargs):
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world_size))
        calls["world" if len(ranks) == world_size else "other"] += 1
        calls["issued"].append((tuple(sorted(ranks)), tensor.numel()))
        return real(tensor, *args, group=group, **kwargs)

    loss = zoo.extract_loss(pm(**make_batch(2 + rank // 2, 4)))
    dist.all_reduce = counting
    try:
        loss.backward()
        pm.sync_grad()
    finally:
        dist.all_reduce = real
    red = pm.reducer
    return {
        **calls,
        "weights": sum(1 for p in pm.parameters() if p.requires_grad),
        "grouped_buckets": sum(1 for b in red.buckets if b.group is not None),
        "buckets": len(red.buckets),
    }


def test_backward_reductions_are_bucketed(tmp_path) -> None:
    """All six weights' gradients are summed by the reducer's buckets (one here), not one all-reduce each."""
    from tests.dist_util import spawn

    results = spawn(_count_reductions, 4, tmp_path, str(tmp_path / "gen"))
    # NCCL: every rank of a group issues that group's collectives in the same order (same sizes)
    groups = {g for r in results for g, _ in r["issued"]}
    for g in groups:
        seqs = [[n for h, n in results[rank]["issued"] if h == g] for rank in g]
        assert all(seq == seqs[0] for seq in seqs), (g, seqs)
    for r in results:
        assert r["weights"] == 6
        assert r["grouped_buckets"] == r["buckets"] == 1
        assert r["world"] == 1 < r["weights"]
        assert r["other"] == 0


def _data_in_two_stages(graph, cfg):
    """Two pipeline stages (the second from gpt's second block), each splitting the batch over its 2
    devices as the `data` policy does."""
    from nnscaler import ComputeConfig
    from nnscaler.policies import PipelinePlan, Plan
    from nnscaler.policies.builtin import pas_data
    from nnscaler.policies.staging import pivot_starts

    inner = pas_data(graph, ComputeConfig(2, 2))
    blocks = pivot_starts(graph, ("Block",))
    starts = (graph.nodes[0].name, graph.nodes[blocks[1][0]].name)
    staged = Plan("data_pp", cfg.plan_ngpus, inner.nodes, pipeline=PipelinePlan(starts, pp_size=2, nmicros=1))
    return cfg.apply_pipeline_scheduler(staged, 2, 2, "1f1b")


def test_pipeline_stages_with_replicas(tmp_path) -> None:
    """plan 4 = 2 stages x a batch split over 2, times 2 replicas (8 ranks). The stage weights go to the
    reducer; the embedding tied to the head (held by both stages) keeps its copy_to_group, its gradient
    summed over the stages by sync_tied_grads."""
    config = {"use_end2end": True}
    run_parity(
        "gpt",
        _data_in_two_stages,
        4,
        8,
        steps=2,
        tmp_path=tmp_path,
        nmicros=2,
        optimizer="sgd",
        config_kwargs=config,
    )
    first, last = _gencode(tmp_path, 0), _gencode(tmp_path, 2)
    assert "self.reduce_grad_over(" in first and "self.reduce_grad_over(" in last
    assert "self.add_tied(" in first
    tied = [line for line in first.splitlines() if "self.add_tied(" in line]
    (name,) = [line.split('"')[1] for line in tied]
    assert f'reduce_grad_over("{name}"' not in first and f"copy_to_group(self.{name}," in first


def test_two_d_mesh_axis_with_replicas(tmp_path) -> None:
    """A 2 x 2 mesh (batch x tensor) times 2 replicas: a weight held whole along the batch axis (and
    maybe split along the other) is summed over that axis's ranks of both replicas: groups of 4 of 8."""
    from tests.mesh2d_policy import data_x_tp

    run_parity("mlp", data_x_tp, 4, 8, steps=2, tmp_path=tmp_path, optimizer="sgd")
    lines = [line for line in _gencode(tmp_path, 1).splitlines() if "self.reduce_grad_over(" in line]
    assert lines and all(line.count(",") == 4 for line in lines), lines  # name + 4 ranks


def test_context_and_expert_parallel_with_replicas(tmp_path) -> None:
    """cp 2 (sequence split) and ep 2 (tokens split, the non-expert weights whole), each x 2 replicas."""
    from tests.parity import ParityCase, run_parity_many

    cp = {"pas_config": {"cp_size": 2, "cp_kind": "zigzag"}}
    ep = {"pas_config": {"ep_size": 2}}
    cases = [
        ParityCase("tests.models_long:build_gpt_long", "tp", 2, cp, optimizer="sgd"),
        ParityCase("tests.models_moe:build_mixtral", "tp", 2, ep, optimizer="sgd"),
    ]
    run_parity_many(cases, 4, tmp_path=tmp_path, timeout=600)
    for k in range(len(cases)):
        (code,) = sorted((tmp_path / "gen" / f"case{k}").rglob("gencode0.py"))
        src = code.read_text()
        assert "self.reduce_grad_over(" in src and "copy_to_group(self." not in src


def test_hierarchical_allreduce_beside_summed_weights(tmp_path, monkeypatch) -> None:
    """Two "nodes" of 4 ranks, data-parallel groups of 4 (2 per node): the plain buckets (gpt's position
    embedding, whose lookup is not split) go through the hierarchical all-reduce, the summed weights'
    buckets through one all-reduce over their 8 ranks."""
    monkeypatch.setenv("NNSCALER_NODE_SIZE", "4")
    config = {"hierarchical_allreduce": True}
    run_parity("gpt", "data", 2, 8, steps=2, tmp_path=tmp_path, optimizer="sgd", config_kwargs=config)
    src = _gencode(tmp_path)
    assert "self.reduce_grad_over(" in src
    shards = [
        line.split('"')[1]
        for line in src.splitlines()
        if "self.add_shard(" in line and "is_param=False" not in line
    ]
    summed = {line.split('"')[1] for line in src.splitlines() if "self.reduce_grad_over(" in line}
    assert set(shards) - summed, "some weight should stay with the plain (hierarchical) buckets"


def test_reduce_grad_over_refuses_what_it_cannot_reduce() -> None:
    """Unknown names, a group without this rank's replicas, and a module without replicas: clear errors."""
    from nnscaler.errors import ConfigError
    from tests.runtime.test_module import Gen

    pm = Gen(0, 1, 1, init_params=False)
    with pytest.raises(KeyError, match="'nope' is not registered"):
        pm.reduce_grad_over("nope", [0])
    with pytest.raises(ValueError, match=r"must hold this rank's data-parallel group \[0\]"):
        pm.reduce_grad_over("fc1_weight", [1, 2])
    pm.reduce_grad_over("fc1_weight", [0])
    with pytest.raises(ConfigError, match="needs data-parallel replicas and not ZeRO 3: generate it again"):
        pm.reducer  # noqa: B018
