"""Dropout under tensor parallelism: ranks sharing a replicated activation draw identical masks;
ranks holding different shards of an activation draw independent masks."""

from __future__ import annotations

import inspect
import sys

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


def _gpt_with_attention_dropout():
    from examples.nanogpt.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=64, n_layer=1, n_head=4, n_embd=32, dropout=0.3)).train()
    g = torch.Generator().manual_seed(5)
    batch = {
        "idx": torch.randint(0, 64, (2, 16), generator=g),
        "targets": torch.randint(0, 64, (2, 16), generator=g),
    }
    return model, batch


def _run_attention(rank, world_size, tmp):
    from nnscaler import parallelize
    from nnscaler.runtime import rng

    model, batch = _gpt_with_attention_dropout()
    pm = parallelize(model, batch, "tp", ComputeConfig(2, 2), gen_savedir=tmp)
    torch.manual_seed(99)
    losses = [pm(**batch).item() for _ in range(3)]
    group = pm.group("tp")
    torch.manual_seed(7)
    with rng.shard_rng(group, torch.device("cpu")):
        inside = torch.rand(100)
    after = torch.rand(5)
    torch.manual_seed(7)
    untouched = torch.rand(5)
    return {"losses": losses, "inside": inside, "after": after, "untouched": untouched}


def test_attention_dropout_on_head_shards(tmp_path):
    """sdpa's own dropout on split heads runs under the shard generator; the default stream stays in step."""
    model, batch = _gpt_with_attention_dropout()
    graph = capture(model, batch)
    program = apply_plan(graph, make_plan(graph, "tp", ComputeConfig(2, 2)))
    sdpa = [s for s in program.statements if s.op == "aten.scaled_dot_product_attention.default"]
    assert sdpa and all(s.shard_rng for s in sdpa)
    a, b = spawn(_run_attention, 2, tmp_path, str(tmp_path / "gen"))
    assert a["losses"] == b["losses"] and len(set(a["losses"])) == 3
    assert not torch.equal(a["inside"], b["inside"]), "head shards drew the same attention-dropout masks"
    assert torch.equal(a["after"], a["untouched"]) and torch.equal(b["after"], b["untouched"])
    code = next(tmp_path.glob("**/gencode0.py")).read_text()
    assert "with rng.shard_rng(tp, self.device):" in code


class DropBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(16, 64)
        self.down = nn.Linear(64, 16)

    def forward(self, x):
        h = F.dropout(F.gelu(self.up(x)), 0.5, self.training)  # sharded under tp
        return F.dropout(self.down(h), 0.5, self.training)  # replicated


class DropNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = DropBlock()

    def forward(self, x, y):
        return F.mse_loss(self.block(x), y)


def _grads_with_and_without_recompute(rank, world_size, tmp):
    from nnscaler import parallelize
    from nnscaler.runtime import rng

    out = {}
    for name, pas in (("plain", {}), ("recompute", {"recompute_modules": "DropBlock"})):
        torch.manual_seed(0)
        cfg = ComputeConfig(2, 2, pas_config=pas)
        pm = parallelize(DropNet().train(), _batch(), "tp", cfg, gen_savedir=f"{tmp}/{name}")
        rng._GENERATORS.clear()  # both runs start the shard streams from the seed
        torch.manual_seed(1234)
        loss = pm(**_batch())
        loss.backward()
        out[name] = {
            "loss": loss.item(),
            "grads": {pm.fullmap[n].original_name: p.grad.clone() for n, p in pm.named_parameters()},
            "code": inspect.getsource(sys.modules[type(pm).__module__]),
        }
    return out


def test_recompute_replays_sharded_dropout_masks(tmp_path):
    """Backward recomputes the block: it must draw the forward's masks, also the shard-stream ones."""
    results = spawn(_grads_with_and_without_recompute, 2, tmp_path, str(tmp_path))
    for r in results:
        assert "context_fn=rng.recompute_contexts(tp, self.device)" in r["recompute"]["code"]
        assert r["recompute"]["loss"] == r["plain"]["loss"]
        for name, grad in r["plain"]["grads"].items():
            torch.testing.assert_close(r["recompute"]["grads"][name], grad, rtol=0, atol=0, msg=name)
