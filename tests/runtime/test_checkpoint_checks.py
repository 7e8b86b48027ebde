"""Checkpoints cannot merge or load wrong (issue 10): every piece carries its rank, plan and shard
metadata, and merge / load verify them.

Pieces come from one real 2-rank gloo run of the hand-written tp module of test_module: a plan over
2 devices (tensor parallel) and a plan over 1 (data parallel), each trained one AdamW step, plus a
second "compile" of the tp layout (another plan fingerprint). The checks then run in this process:
metadata lost through safetensors, pieces of different plans (dp with tp), optimizer state dicts in
another order (paired by rank) or unpaired, diverged replicas, what load_merged_state_dict(strict=False)
skipped, a module on the meta device given to parallelize, and the compiler's plan fingerprint.
"""

from __future__ import annotations

import copy
import importlib.util
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

from nnscaler import ComputeConfig, parallelize
from nnscaler.errors import CheckpointError, ConfigError
from nnscaler.runtime import (
    build_optimizer,
    load_merged_state_dict,
    load_sharded_state_dict,
    merge_state_dicts,
)
from nnscaler.runtime.checkpoint.formats import OPTIMIZER_META_KEY

try:
    from .dist_util import run_dist
    from .test_module import BATCH, LR, Gen, Wrapper, _cpu, _fresh, _same_opt, _same_state, _setup
except ImportError:
    from dist_util import run_dist
    from test_module import BATCH, LR, Gen, Wrapper, _cpu, _fresh, _same_opt, _same_state, _setup

TP, DP, OTHER = 2, 1, "other"


class Replanned(Gen):
    """The tp layout again, as another compile would give it: another plan fingerprint."""

    plan_fingerprint = "another-compile-of-the-tp-layout"


def _train_one_step(rank: int, world: int, plan: int) -> tuple[dict[str, Any], dict[str, Any]]:
    _, full, x, t = _setup()
    pm = Gen(rank, world, plan, init_params=False)
    pm.compute_config = ComputeConfig(plan, world)
    pm.load_merged_state_dict(full)
    opt = build_optimizer(pm, torch.optim.AdamW, lr=LR, weight_decay=0.1)
    replicas = world // plan
    rows = slice(rank // plan * BATCH // replicas, (rank // plan + 1) * BATCH // replicas)
    pm(x[rows], t[rows]).backward()
    opt.step()
    return _cpu(pm.state_dict()), copy.deepcopy(opt.state_dict())


def pieces_worker(rank: int, world: int) -> dict[Any, Any]:
    out: dict[Any, Any] = {TP: _train_one_step(rank, world, TP), DP: _train_one_step(rank, world, DP)}
    _, full, x, t = _setup()
    other = Replanned(rank, world, TP, init_params=False)
    other.load_merged_state_dict(full)
    out[OTHER] = _cpu(other.state_dict())

    # a rank's own state dicts load back only with their metadata, and only on their rank
    sd, opt_sd = out[TP]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, opt_sd)
    pm, opt = _fresh(rank, world, TP)
    tensors_only = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(
        CheckpointError, match="load_sharded_state_dict: the model state dict has no ParallelModule"
    ):
        load_sharded_state_dict(pm, tensors_only)
    with pytest.raises(CheckpointError, match=f"saved by rank {1 - rank} .* this is rank {rank}"):
        load_sharded_state_dict(pm, sd, opt, everyone[1 - rank])
    with pytest.raises(RuntimeError, match=f"saved by rank {rank} of a different plan"):
        load_sharded_state_dict(pm, out[OTHER])  # this rank's layout, but another compile
    load_sharded_state_dict(pm, sd, opt, opt_sd)
    _same_state(pm.state_dict(), sd, "load_sharded_state_dict")

    if rank == 0:  # the single-device model after the same step
        ref, _, x, t = _setup()
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.1)
        ref(x, t).backward()
        ref_opt.step()
        out["ref"], out["ref_opt"] = _cpu(ref.state_dict()), ref_opt.state_dict()
    return out


@pytest.fixture(scope="module")
def pieces() -> list[dict[Any, Any]]:
    return run_dist(pieces_worker, 2, timeout=110)


def _models(pieces: list[dict[Any, Any]], plan: Any) -> list[dict[str, Any]]:
    return [copy.deepcopy(p[plan][0] if plan != OTHER else p[plan]) for p in pieces]


def _optims(pieces: list[dict[Any, Any]], plan: Any) -> list[dict[str, Any]]:
    return [copy.deepcopy(p[plan][1]) for p in pieces]


# ---- merge ----------------------------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_optimizer_state_dicts_pair_by_recorded_rank(pieces: list[dict[Any, Any]]) -> None:
    ref, ref_opt = pieces[0]["ref"], pieces[0]["ref_opt"]
    for plan in (TP, DP):
        models, optims = _models(pieces, plan), _optims(pieces, plan)
        merged, merged_opt = merge_state_dicts(models, optims[::-1])  # another order than the models'
        _same_state(merged, ref, f"plan {plan}: merged model")
        assert merged_opt is not None
        _same_opt(merged_opt, ref_opt, f"plan {plan}: merged optimizer from shuffled state dicts")
    # without the recorded ranks (an older checkpoint) the order is all there is, and a wrong one
    # gives wrong Adam moments: why every piece now records its rank
    legacy = [{k: v for k, v in o.items() if k != OPTIMIZER_META_KEY} for o in _optims(pieces, TP)]
    with pytest.warns(UserWarning, match="paired with the model state dicts by position"):
        _, wrong = merge_state_dicts(_models(pieces, TP), legacy[::-1])
    assert wrong is not None
    j = wrong["param_groups"][0]["param_names"].index("fc1.weight")
    assert not torch.allclose(wrong["state"][j]["exp_avg"], ref_opt["state"][j]["exp_avg"])


def test_optimizer_state_dicts_that_do_not_pair_raise(pieces: list[dict[Any, Any]]) -> None:
    models, optims = _models(pieces, TP), _optims(pieces, TP)
    with pytest.raises(
        CheckpointError, match=r"come from ranks \[0\] but the model state dicts from ranks \[0, 1\]"
    ):
        merge_state_dicts(models, optims[:1])
    with pytest.raises(CheckpointError, match="optimizer state dicts #0 and #1 both come from rank 0"):
        merge_state_dicts(models, [optims[0], optims[0]])
    dp_optims = _optims(pieces, DP)
    with pytest.raises(
        CheckpointError, match="optimizer state dict of rank 0 was saved under plan .* but its model"
    ):
        merge_state_dicts(models, dp_optims)
    bare = {k: v for k, v in optims[1].items() if k != OPTIMIZER_META_KEY}
    with pytest.raises(CheckpointError, match=r"optimizer state dicts \[1\] record no rank"):
        merge_state_dicts(models, [optims[0], bare])


def test_metadata_lost_through_safetensors_is_detected(pieces: list[dict[Any, Any]], tmp_path: Any) -> None:
    from safetensors.torch import load_file, save_file

    models = _models(pieces, TP)
    round_tripped = []
    for rank, sd in enumerate(models):
        path = tmp_path / f"rank{rank}.safetensors"
        save_file({k: v.contiguous() for k, v in sd.items() if isinstance(v, torch.Tensor)}, str(path))
        round_tripped.append(load_file(str(path)))
    with pytest.raises(
        CheckpointError, match=r"model state dict #0 has no ParallelModule metadata .*safetensors"
    ):
        merge_state_dicts(round_tripped)
    with pytest.raises(CheckpointError, match="model state dict #1 has no ParallelModule metadata"):
        merge_state_dicts([models[0], round_tripped[1]])
    # kept beside the tensors and put back, the pieces merge again
    restored = [{**sd, "_extra_state": m["_extra_state"]} for sd, m in zip(round_tripped, models)]
    merged, _ = merge_state_dicts(restored)
    _same_state(merged, pieces[0]["ref"], "merged after the metadata was put back")


def test_pieces_of_different_plans_raise_naming_the_ranks(pieces: list[dict[Any, Any]]) -> None:
    tp, dp, other = _models(pieces, TP), _models(pieces, DP), _models(pieces, OTHER)
    with pytest.raises(CheckpointError, match="different plans") as err:
        merge_state_dicts([tp[0], dp[1]])
    text = str(err.value)
    assert "ranks [0]: tensor/pipeline parallel over 2 devices" in text, text
    assert "ranks [1]: data parallel: every rank holds whole tensors" in text, text
    assert "missing pieces" not in text, text
    with pytest.raises(CheckpointError, match=r"different plans.*ranks \[0\].*ranks \[1\]"):
        merge_state_dicts([tp[0], other[1]])  # same layout, another compile
    merged, _ = merge_state_dicts(other)  # one compile's pieces merge
    assert torch.equal(merged["fc1.weight"], _setup()[1]["fc1.weight"])


def test_missing_piece_and_repeated_rank(pieces: list[dict[Any, Any]]) -> None:
    tp = _models(pieces, TP)
    with pytest.raises(
        CheckpointError, match=r"missing pieces \[1\] of 2 \(given: piece 0 from rank 1\).*ranks 0 to 1"
    ):
        merge_state_dicts([tp[1]])
    with pytest.raises(CheckpointError, match="model state dicts #0 and #1 both come from rank 0"):
        merge_state_dicts([tp[0], tp[0]])


def test_diverged_replicas_raise_naming_parameter_and_ranks(pieces: list[dict[Any, Any]]) -> None:
    ref = pieces[0]["ref"]
    models, optims = _models(pieces, DP), _optims(pieces, DP)
    merge_state_dicts(models, optims)  # trained replicas agree
    models[1]["fc1.weight"][0, 0] += 1e-3
    with pytest.raises(
        CheckpointError, match=r"ranks 0 and 1 hold different copies of fc1\.weight \(max difference"
    ):
        merge_state_dicts(models)
    merged, _ = merge_state_dicts(models, check_replicas=False)  # takes the lowest rank's copy
    torch.testing.assert_close(merged["fc1.weight"], ref["fc1.weight"], rtol=1e-5, atol=1e-6)
    models[1]["fc1.weight"][0, 0] -= 1e-3 - 1e-9  # within tolerance: rounding, not divergence
    merge_state_dicts(models)
    j = optims[1]["param_groups"][0]["param_names"].index("fc2.bias")
    optims[1]["state"][j]["exp_avg"] += 0.1
    with pytest.raises(CheckpointError, match="optimizer state 'exp_avg' of fc2.bias"):
        merge_state_dicts(models, optims)
    # replicated tensors of a tp plan are copies too
    tp = _models(pieces, TP)
    tp[1]["ln.weight"][1] = 7.0
    with pytest.raises(CheckpointError, match=r"ranks 0 and 1 hold different copies of ln\.weight"):
        merge_state_dicts(tp)


# ---- load ------------------------------------------------------------------------------------------


def test_load_merged_state_dict_reports_what_it_skipped(pieces: list[dict[Any, Any]]) -> None:
    merged, merged_opt = merge_state_dicts(_models(pieces, TP), _optims(pieces, TP))
    partial = {k: v for k, v in merged.items() if k != "scale"}
    partial["extra.key"] = torch.zeros(1)
    pm, _ = _fresh(0, 1, 1)
    with pytest.raises(RuntimeError, match=r"missing keys \['scale'\], unexpected keys \['extra\.key'\]"):
        load_merged_state_dict(pm, partial)
    assert torch.all(pm.fc1_weight == 123.0), "strict raises before loading anything"
    with pytest.warns(
        UserWarning, match=r"1 missing keys .*\['scale'\]; 1 unexpected keys .*\['extra\.key'\]"
    ):
        result = load_merged_state_dict(pm, partial, strict=False)
    assert result.missing_keys == ["scale"] and result.unexpected_keys == ["extra.key"]
    assert torch.equal(pm.fc1_weight, merged["fc1.weight"]) and torch.all(pm.scale == 123.0)

    # nothing matches: raise even without strict, saying which prefix to strip or add
    prefixed = {f"module.{k}": v for k, v in merged.items()}
    with pytest.raises(RuntimeError, match=r"none of the 9 keys .*strip it.*removeprefix\('module\.'\)"):
        load_merged_state_dict(pm, prefixed, strict=False)
    wrapped, _ = _fresh(0, 1, 1)
    with pytest.raises(RuntimeError, match="the module's names start with 'body.'"):
        load_merged_state_dict(Wrapper(wrapped), merged, strict=False)
    with pytest.raises(RuntimeError, match="one rank's state dict, not a merged one"):
        load_merged_state_dict(pm, _models(pieces, TP)[0], strict=False)
    with pytest.raises(RuntimeError, match="the state dict is empty"):
        load_merged_state_dict(pm, {}, strict=False)
    with pytest.raises(RuntimeError, match="none of the keys matches .*'module.scale'"):
        pm.load_merged_state_dict(prefixed, strict=False)  # the ParallelModule's own method too

    # the optimizer state dict must cover the optimizer's parameters
    pm, opt = _fresh(0, 1, 1)
    assert merged_opt is not None
    names = merged_opt["param_groups"][0]["param_names"]
    j = names.index("scale")
    short = copy.deepcopy(merged_opt)
    short["param_groups"][0]["param_names"] = [n for n in names if n != "scale"]
    short["param_groups"][0]["params"] = list(range(len(names) - 1))
    short["state"] = {i: merged_opt["state"][k] for i, k in enumerate(k for k in range(len(names)) if k != j)}
    with pytest.raises(CheckpointError, match=r"no entry for parameters \['scale'\]"):
        load_merged_state_dict(pm, merged, opt, short)
    load_merged_state_dict(pm, merged, opt, merged_opt)


# ---- parallelize ---------------------------------------------------------------------------------------


def test_meta_device_module_refuses_to_load(tmp_path: Any) -> None:
    from tests import zoo

    real, make_batch = zoo.build("mlp")
    batch = make_batch(0, 4)
    meta = copy.deepcopy(real).to("meta")
    kw: dict[str, Any] = {"gen_savedir": tmp_path, "instance_name": "meta"}
    with pytest.raises(ConfigError, match=r"weights are on the meta device .*init_module_params=False"):
        parallelize(meta, batch, "dp", ComputeConfig(1, 1), **kw)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = parallelize(meta, batch, "dp", ComputeConfig(1, 1), init_module_params=False, **kw)
    assert not [w for w in caught if "meta" in str(w.message)], [str(w.message) for w in caught]
    load_merged_state_dict(pm, real.state_dict())  # the promised weights
    torch.testing.assert_close(pm(**batch), real(**batch))


def _plan_fingerprint(path: Any) -> str:
    spec = importlib.util.spec_from_file_location(f"_gencode_{abs(hash(str(path)))}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GenModel.plan_fingerprint


def test_compiled_code_names_its_plan(tmp_path: Any) -> None:
    from tests import zoo

    model, make_batch = zoo.build("mlp")
    batch = make_batch(0, 4)

    def compiled(policy: str, instance: str, **kw: Any) -> list[str]:
        cfg = ComputeConfig(2, 2, **kw)
        parallelize(
            model, batch, policy, cfg, gen_savedir=tmp_path, instance_name=instance, load_module=False
        )
        outdir = next(tmp_path.glob(f"_parallel_modules/**/{instance}"))
        return [_plan_fingerprint(outdir / f"gencode{r}.py") for r in range(2)]

    tp, data = compiled("tp", "tp"), compiled("data", "data")
    assert tp[0] and tp[0] == tp[1], tp  # one plan: the same on every rank
    assert data[0] == data[1] != tp[0], (data, tp)  # another plan over the same devices
    # compiling again, with settings that keep the layout, names the same plan: sharded checkpoints
    # saved before still load
    assert compiled("tp", "again", reducer_bucket_cap_mb=1.0, use_async_reducer=False) == tp


def test_class_built_on_meta_refuses_init_params(tmp_path: Any) -> None:
    from tests import zoo

    real, make_batch = zoo.build("mlp")
    batch = make_batch(0, 4)
    kw: dict[str, Any] = {"gen_savedir": tmp_path, "module_fn": lambda: copy.deepcopy(real).to("meta")}
    with pytest.raises(
        ConfigError, match=r"module_fn builds the model on the meta device.*init_module_params=False"
    ):
        parallelize(type(real), batch, "dp", ComputeConfig(1, 1), instance_name="a", **kw)
    # compile only, or a promise to load weights later: accepted
    assert (
        parallelize(type(real), batch, "dp", ComputeConfig(1, 1), instance_name="b", load_module=False, **kw)
        is None
    )
    gen = parallelize(
        type(real), batch, "dp", ComputeConfig(1, 1), instance_name="c", init_module_params=False, **kw
    )
    pm = gen(init_params=False)
    load_merged_state_dict(pm, real.state_dict())
    torch.testing.assert_close(pm(**batch), real(**batch))
