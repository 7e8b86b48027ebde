"""train()/eval() on a compiled module does what it does on the original (issue 9), under dp, tp and pp.

Compiled in train mode, `pm.eval()` turns dropout off and makes batch norm use its running
statistics: eval losses equal the original's. Compiled in eval mode, `pm.train()` turns them on:
batch-norm running statistics (and num_batches_tracked) update as the original's do.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tests.dist_util import spawn

WIDTH = 16


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.bn = nn.BatchNorm1d(WIDTH)

    def forward(self, x):
        return F.dropout(F.relu(self.bn(self.fc(x))), 0.3, self.training)


class ModeNet(nn.Module):
    """Dropout after batch norm: the first batch norm's statistics do not depend on random masks."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(self.head(x), y)


def batch(seed: int, rows: int = 8) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(rows, WIDTH, generator=g) * 2 + 1, "y": torch.randn(rows, 8, generator=g)}


def build() -> ModeNet:
    """The same model in every process, with running statistics that are not the initial ones."""
    torch.manual_seed(0)
    model = ModeNet().train()
    with torch.no_grad():
        model(**batch(100))
    return model


EVAL_SEEDS = (10, 11)
"""Eval batches (with a pipeline: the micro-batches of one infer_step)."""


def _train_batches(policy: str, replica: int) -> list[dict[str, torch.Tensor]]:
    """The train-mode forward's batches: one per data-parallel replica, two micro-batches under pp."""
    if policy == "pp":
        return [batch(20), batch(21)]
    return [batch(20 + replica)]


def _run(rank: int, world_size: int, policy: str, plan_ngpus: int, gen_savedir: str) -> dict:
    import nnscaler
    from nnscaler import ComputeConfig, merge_state_dicts, parallelize

    nnscaler.init()
    extra = {"use_end2end": True, "pas_config": {"pipeline_nmicros": 2}} if policy == "pp" else {}
    cfg = ComputeConfig(plan_ngpus, world_size, **extra)
    out = {}
    for traced in ("train", "eval"):
        model = build().train(traced == "train")
        pm = parallelize(model, batch(1), policy, cfg, gen_savedir=gen_savedir, instance_name=traced)
        assert pm.training == model.training
        pm.eval()
        samples = [batch(s) for s in EVAL_SEEDS]
        if policy == "pp":
            eval_losses = [float(x) for x in pm.infer_step(samples)]
            again = [float(x) for x in pm.infer_step(samples)]
        else:
            with torch.no_grad():
                eval_losses = [float(pm(**s)) for s in samples]
                again = [float(pm(**s)) for s in samples]
        pm.train()
        train_batches = _train_batches(policy, rank // plan_ngpus)
        torch.manual_seed(7)
        if policy == "pp":
            train_losses = [[float(x) for x in pm.train_step(train_batches)] for _ in range(2)]
        else:
            train_losses = []
            for _ in range(2):
                loss = pm(**train_batches[0])
                loss.backward()
                train_losses.append(float(loss.detach()))
        states: list = [None] * world_size
        state = {
            k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in pm.state_dict().items()
        }
        dist.all_gather_object(states, state)
        merged, _ = merge_state_dicts(states)
        out[traced] = {
            "eval": eval_losses,
            "eval_again": again,
            "train": train_losses,
            "stats": {k: v for k, v in merged.items() if ".bn." in k},
        }
    return out


def _reference(policy: str, replicas: int) -> dict:
    model = build().eval()
    with torch.no_grad():
        eval_losses = [float(model(**batch(s))) for s in EVAL_SEEDS]
    model.train()
    with torch.no_grad():
        for _ in range(2):  # two train-mode steps, as the parallel side
            if policy == "pp":
                for b in _train_batches(policy, 0):
                    model(**b)
            else:
                parts = [_train_batches(policy, r)[0] for r in range(replicas)]
                model(**{k: torch.cat([p[k] for p in parts]) for k in parts[0]})
    return {"eval": eval_losses, "stats": {k: v for k, v in model.state_dict().items() if ".bn." in k}}


CASES = {
    # id: (policy, plan_ngpus, runtime_ngpus)
    "dp-1x2": ("dp", 1, 2),
    "tp-2": ("tp", 2, 2),
    "pp-2": ("pp", 2, 2),
}


@pytest.mark.parametrize("case", list(CASES))
def test_train_eval_follow_the_module(case, tmp_path):
    policy, plan, runtime = CASES[case]
    results = spawn(_run, runtime, tmp_path, policy, plan, str(tmp_path / "gen"))
    ref = _reference(policy, runtime // plan)
    for traced in ("train", "eval"):
        for r in results:
            got = r[traced]
            # eval(): dropout off, running statistics: the original's eval losses, every call alike
            assert got["eval"] == pytest.approx(ref["eval"], rel=1e-5), (traced, got["eval"], ref["eval"])
            assert got["eval_again"] == got["eval"]
            # train(): dropout on (two steps on one batch differ; batch-norm statistics moved between them too)
            assert got["train"][0] != got["train"][1]
        stats = results[0][traced]["stats"]
        assert stats.keys() == ref["stats"].keys()
        for name in ("blocks.0.bn.running_mean", "blocks.0.bn.running_var"):
            # the first batch norm sees no dropout: its statistics match the original's exactly
            torch.testing.assert_close(stats[name], ref["stats"][name], rtol=1e-5, atol=1e-6)
        for name in ("blocks.0.bn.num_batches_tracked", "blocks.1.bn.num_batches_tracked"):
            assert int(stats[name]) == int(ref["stats"][name]), (traced, name)


def test_planning_capture_of_one_mode_has_the_same_nodes():
    """capture(both_modes=False) (python -m nnscaler.plan) traces once: the same nodes and names as the
    compile's two-mode trace, with the train-mode literals plain instead of following the mode."""
    from torch.utils import _pytree as pytree

    from nnscaler.graph.capture import capture
    from nnscaler.graph.ir.mode import ModeValue

    def mode_values(graph) -> int:
        leaves = pytree.tree_leaves([(n.args, n.kwargs) for n in graph.nodes])
        return sum(isinstance(v, ModeValue) for v in leaves)

    both = capture(build(), batch(1))
    once = capture(build(), batch(1), both_modes=False)
    assert [(n.name, n.op) for n in once.nodes] == [(n.name, n.op) for n in both.nodes]
    assert mode_values(both) >= 2 and mode_values(once) == 0  # dropout's train flag, batch norm's
