"""nnScaler 0.8 compatibility, one process: its `nnscaler.parallel` import path,
`ParallelModule.merge_partial_states`, dummy-argument keys the forward does not take, nested
parallel modules, `global_batch_size: 0`, `pp` without pivots, autodist's `update_freq` /
`task_name` (docs/runtime.md, "Coming from nnScaler 0.8"). Multi-rank ones: test_nnscaler08_compat_dist.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import nnscaler
import nnscaler.parallel
from nnscaler import ComputeConfig, parallelize
from nnscaler.cli.trainer_args import TrainerArgs
from nnscaler.errors import ConfigError
from nnscaler.graph.capture import capture
from nnscaler.policies import pas_pp
from nnscaler.policies.options import parse_pas_config

NAMES_08 = (  # what nnScaler 0.8's docs and tests import from nnscaler.parallel
    "parallelize ComputeConfig build_optimizer merge_state_dicts load_merged_state_dict broadcast_weights "
    "sync_grad_when ReuseType BroadcastGenFilesStrategy ParallelModule deduped_state_dict "
    "load_deduped_state_dict load_sharded_state_dict"
).split()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.fc2 = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


class Outer(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.inner(x))


class Flat(nn.Module):
    """No repeated layers (no ModuleList): `pp` cannot find pivots."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 4)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).sum()


def _x() -> torch.Tensor:
    return torch.arange(8.0).reshape(2, 4) / 8


def test_nnscaler_parallel_exports_the_0_8_names_as_the_same_objects():
    for name in NAMES_08:
        assert getattr(nnscaler.parallel, name) is getattr(nnscaler, name), name
        assert name in nnscaler.parallel.__all__, name
    ns: dict = {}
    exec("from nnscaler.parallel import " + ", ".join(NAMES_08), ns)
    assert set(NAMES_08) <= set(ns)


def test_merge_partial_states_merges_model_and_optimizer(tmp_path):
    torch.manual_seed(0)
    model = Net()
    pm = parallelize(model, {"x": _x()}, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path)
    opt = nnscaler.build_optimizer(pm, torch.optim.Adam, lr=0.1)
    pm(_x()).sum().backward()
    opt.step()
    entry = (pm.state_dict(), opt.state_dict(), pm.dist_param_map, pm.fullmap)
    got_model, got_opt = pm.merge_partial_states([entry])
    want_model, want_opt = nnscaler.merge_state_dicts([entry[0]], [entry[1]])
    assert set(got_model) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    for name, value in want_model.items():
        torch.testing.assert_close(got_model[name], value)
    assert got_opt["state"].keys() == want_opt["state"].keys() and len(got_opt["state"]) == 4
    torch.testing.assert_close(got_opt["state"][0]["exp_avg"], want_opt["state"][0]["exp_avg"])
    # the trained weights, not the initial ones
    assert not torch.equal(got_model["fc1.weight"], model.fc1.weight)
    with pytest.warns(UserWarning, match="zero_idx_maps is ignored"):
        pm.merge_partial_states([entry, (None, None, None, None)], zero_idx_maps=[{}])


def test_dummy_args_the_forward_does_not_take_are_ignored_with_a_warning(tmp_path):
    model = Net()
    with pytest.warns(UserWarning, match=r"\['label', 'mask'\] are ignored.*Net\.forward\(x\)"):
        pm = parallelize(
            model,
            {"x": _x(), "label": torch.ones(2), "mask": None},
            "dp",
            ComputeConfig(1, 1),
            gen_savedir=tmp_path,
        )
    torch.testing.assert_close(pm(_x()), model(_x()))
    with pytest.raises(Exception, match="missing forward argument 'x'"):  # a missing one still raises
        parallelize(Net(), {"label": _x()}, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path / "b")


def test_nested_parallel_modules_raise_nnscalers_error(tmp_path):
    inner = parallelize(Net(), {"x": _x()}, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path)
    with pytest.raises(
        RuntimeError, match=r"Parallel modules can not be nested\. Outer .*\['inner'\]"
    ) as err:
        parallelize(Outer(inner), {"x": _x()}, "dp", ComputeConfig(1, 1), gen_savedir=tmp_path)
    assert isinstance(err.value, ConfigError)


def _trainer_args(**batch) -> TrainerArgs:
    return TrainerArgs.from_dict(
        {
            "compute_config": {"plan_ngpus": 1, "runtime_ngpus": 4},
            "model": {"type": "examples.nanogpt.model.GPT"},
            "optimizer": {"type": "torch.optim.SGD"},
            "dataset": {"type": "tests.cli.common.CountingTokens"},
            "max_train_steps": 1,
            "micro_batch_size": 2,
            **batch,
        }
    )


def test_global_batch_size_zero_means_derive_it():
    args = _trainer_args(global_batch_size=0)
    assert (args.global_batch_size, args.grad_accumulation_steps) == (8, 1)
    args = _trainer_args(global_batch_size=0, grad_accumulation_steps=3)
    assert (args.global_batch_size, args.grad_accumulation_steps) == (24, 3)
    with pytest.raises(ConfigError, match="global_batch_size must be >= 1"):
        _trainer_args(global_batch_size=-4)


def _start_indices(graph, plan) -> list[int]:
    index = {node.name: i for i, node in enumerate(graph.nodes)}
    return [index[name] for name in plan.pipeline.starts]


@pytest.mark.parametrize("nstages", [2, 3])
def test_pp_without_pivots_splits_the_operators_evenly(nstages):
    graph = capture(Flat(), {"x": _x()}, both_modes=False)
    n = len(graph.nodes)
    cfg = ComputeConfig(nstages, nstages, use_end2end=True, pas_config={"pipeline_nmicros": nstages})
    with pytest.warns(UserWarning, match=f"split the {n} operators evenly"):
        plan = pas_pp(graph, cfg)
    starts = _start_indices(graph, plan)
    sizes = [b - a for a, b in zip(starts, [*starts[1:], n])]
    assert starts[0] == 0 and len(sizes) == nstages and min(sizes) >= 1
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True), sizes


def test_autodist_accepts_update_freq_and_names_task_name_in_a_warning():
    with pytest.warns(UserWarning, match="'task_name'.*ignored"):
        opts = parse_pas_config("autodist", {"update_freq": [4, 2], "task_name": "run1"})
    assert opts.pipeline_nmicros == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse_pas_config("autodist", {"update_freq": 2, "pipeline_nmicros": 3}).pipeline_nmicros == 3
        assert parse_pas_config("autodist", {"update_freq": 2}).pipeline_nmicros == 2
    with pytest.raises(ConfigError, match="update_freq"):
        parse_pas_config("autodist", {"update_freq": "four"})
