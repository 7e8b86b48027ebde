"""Dropout under tensor parallelism: ranks sharing a replicated activation draw identical masks;
ranks holding different shards of an activation draw independent masks."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from nnscaler import ComputeConfig
from nnscaler.graph.capture import capture
from nnscaler.partition import apply_plan
from nnscaler.policies import make_plan
from tests.dist_util import spawn


class DropMLP(nn.Module):
    """Dropout after a column-parallel linear (sharded) and after the row-parallel one (replicated)."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x, y):
        h = F.dropout(F.gelu(self.up(x)), 0.5, self.training)
        out = F.dropout(self.down(h), 0.5, self.training)
        return F.mse_loss(out, y)


def _batch():
    g = torch.Generator().manual_seed(3)
    return {"x": torch.randn(8, 16, generator=g), "y": torch.randn(8, 16, generator=g)}


def test_codegen_uses_shard_stream_only_for_sharded_dropout():
    graph = capture(DropMLP().train(), _batch())
    program = apply_plan(graph, make_plan(graph, "tp", ComputeConfig(2, 2)))
    drops = [s for s in program.statements if "dropout" in s.op]
    assert [s.op for s in drops] == ["rng.sharded_dropout", "aten.dropout.default"]


def _run(rank, world_size, tmp):
    import nnscaler
    from nnscaler import parallelize
    from nnscaler.runtime import comm, rng

    torch.manual_seed(0)
    model = DropMLP().train()
    pm = parallelize(model, _batch(), "tp", ComputeConfig(2, 2), gen_savedir=tmp)
    torch.manual_seed(1234)  # same default stream on both ranks
    losses = [pm(**_batch()).item() for _ in range(3)]
    group = pm.group("tp")
    x = torch.ones(1000)
    sharded = rng.sharded_dropout(x, 0.5, True, group)
    replicated = F.dropout(x, 0.5, True)
    return {
        "losses": losses,
        "sharded": sharded,
        "replicated": replicated,
        "rank": comm.rank_in_group(group),
        "nnscaler": nnscaler.__version__,
    }


def test_masks_agree_where_replicated_and_differ_where_sharded(tmp_path):
    a, b = spawn(_run, 2, tmp_path, str(tmp_path / "gen"))
    assert a["losses"] == b["losses"], "replicated dropout masks differ between tensor-parallel ranks"
    assert len(set(a["losses"])) == 3, "dropout is not active"
    assert torch.equal(a["replicated"], b["replicated"])
    assert not torch.equal(a["sharded"], b["sharded"]), "shards drew the same mask"
    keep = (a["sharded"] != 0).float().mean().item()
    assert 0.4 < keep < 0.6
