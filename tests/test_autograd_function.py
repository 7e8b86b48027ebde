"""Custom torch.autograd.Functions keep their backward (issue 9).

A straight-through estimator rounds in forward and passes the gradient through in backward; traced
naively its forward is inlined and its gradient becomes 0. The compiled module calls the Function
itself, so gradients match eager: in one process and under dp and tp on 2 ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from nnscaler.errors import TraceError
from nnscaler.graph.capture import capture
from tests.dist_util import spawn


class RoundSTE(torch.autograd.Function):
    """Straight-through estimator: round in forward, identity gradient in backward."""

    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, grad):
        return grad


class ScaleAndGate(torch.autograd.Function):
    """Two outputs, a non-tensor argument, saved tensors and a hand-written (deliberately odd) gradient."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.save_for_backward(x)
        ctx.scale = scale
        return x * scale, torch.relu(x)

    @staticmethod
    def backward(ctx, grad_scaled, grad_gate):
        (x,) = ctx.saved_tensors
        return grad_scaled * ctx.scale + grad_gate * (x > 0) * 0.5, None


class QuantNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x, y):
        h = RoundSTE.apply(self.fc1(x) * 4) / 4
        scaled, gate = ScaleAndGate.apply(h, 0.5)
        return F.mse_loss(self.fc2(scaled + gate), y)


def batch(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(6, 8, generator=g), "y": torch.randn(6, 4, generator=g)}


def build() -> QuantNet:
    torch.manual_seed(0)
    return QuantNet()


def eager_grads(batches: list[dict[str, torch.Tensor]]) -> tuple[float, dict[str, torch.Tensor]]:
    """Loss and gradients of the original model on the batches concatenated (dp replicas' union)."""
    model = build()
    whole = {k: torch.cat([b[k] for b in batches]) for k in batches[0]}
    loss = model(**whole)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_function_is_one_node_named_after_it():
    graph = capture(build(), batch(1))
    ops = [n.op for n in graph.nodes if n.op.endswith(".apply")]
    assert ops == [f"{__name__}:RoundSTE.apply", f"{__name__}:ScaleAndGate.apply"]
    assert not any(n.op == "aten.round.default" for n in graph.nodes), "the forward was inlined"


def test_single_process_gradient_matches_eager(tmp_path):
    import nnscaler

    data = batch(3)
    loss, grads = eager_grads([data])
    assert grads["fc1.weight"].abs().sum() > 0  # the straight-through gradient is not zero
    pm = nnscaler.parallelize(build(), batch(1), "dp", nnscaler.ComputeConfig(1, 1), gen_savedir=tmp_path)
    got = pm(**data)
    got.backward()
    assert float(got.detach()) == pytest.approx(loss, rel=1e-6)
    code = next(tmp_path.rglob("gencode0.py")).read_text()
    assert f"{__name__}.RoundSTE.apply(" in code
    for name, p in pm.named_parameters():
        full = name.replace("_", ".")  # fc1_weight -> fc1.weight
        torch.testing.assert_close(p.grad, grads[full], rtol=1e-5, atol=1e-6)


POLICIES = (("dp", 1), ("tp", 2))
"""(policy, plan_ngpus) compiled on 2 ranks: two data-parallel replicas, one tensor-parallel pair."""


def _run(rank: int, world_size: int, gen_savedir: str) -> dict:
    import nnscaler
    from nnscaler import ComputeConfig, parallelize

    nnscaler.init()
    out = {}
    for policy, plan_ngpus in POLICIES:
        cfg = ComputeConfig(plan_ngpus, world_size)
        pm = parallelize(build(), batch(1), policy, cfg, gen_savedir=gen_savedir, instance_name=policy)
        loss = pm(**batch(10 + rank // plan_ngpus))
        loss.backward()
        pm.sync_grad()
        grads = {name: p.grad.detach().clone() for name, p in pm.named_parameters()}
        all_grads: list = [None] * world_size
        dist.all_gather_object(all_grads, grads)
        out[policy] = {
            "loss": float(loss.detach()),
            "grads": all_grads,
            "dist_param_map": dict(pm.dist_param_map),
        }
    return out


def test_gradient_matches_eager_on_two_ranks(tmp_path):
    """dp (1, 2) and tp (2, 2): losses and every rank's gradients match eager (tp: each rank's slice)."""
    results = spawn(_run, 2, tmp_path, str(tmp_path / "gen"))
    for policy, plan_ngpus in POLICIES:
        replicas = 2 // plan_ngpus
        loss, grads = eager_grads([batch(10 + r) for r in range(replicas)])
        runs = [r[policy] for r in results]
        if replicas == 1:
            assert [r["loss"] for r in runs] == pytest.approx([loss, loss], rel=1e-5)
        else:  # each replica's loss is over its own half; gradients are averaged
            assert sum(r["loss"] for r in runs) / 2 == pytest.approx(loss, rel=1e-5)
        checked = 0
        for rank, r in enumerate(runs):
            for local, grad in r["grads"][rank].items():
                full = r["dist_param_map"].get(local, local.replace("_", "."))
                ref = grads[full]
                if grad.shape != ref.shape:  # a tensor-parallel shard: this rank's slice (rows or columns)
                    (dim,) = [d for d, (a, b) in enumerate(zip(grad.shape, ref.shape)) if a != b]
                    n = grad.shape[dim]
                    ref = ref.narrow(dim, (rank % plan_ngpus) * n, n)
                torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6)
                checked += 1
        assert checked >= 4, policy


class _Local:
    @staticmethod
    def make():
        class Hidden(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.round()

            @staticmethod
            def backward(ctx, grad):
                return grad

        return Hidden


class HiddenFnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.fn = _Local.make()

    def forward(self, x):
        return self.fn.apply(self.fc(x)).sum()


class InPlace(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class InPlaceNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return InPlace.apply(self.fc(x) + 1).sum()


def test_functions_that_cannot_be_kept_raise_naming_them():
    with pytest.raises(TraceError, match=r"Hidden.*defined inside a function"):
        capture(HiddenFnNet(), {"x": torch.randn(2, 4)})
    with pytest.raises(TraceError, match=r"InPlace modifies its input in place"):
        capture(InPlaceNet(), {"x": torch.randn(2, 4)})


class SplitSTE(torch.autograd.Function):
    """Registered with an annotation: split under tp, it runs on each rank's shard."""

    @staticmethod
    def forward(ctx, x):
        return x.round()

    @staticmethod
    def backward(ctx, grad):
        return grad


class SplitNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x):
        return self.down(SplitSTE.apply(self.up(x))).sum()


def test_annotated_function_splits_under_tp():
    from nnscaler import ComputeConfig, register_op
    from nnscaler.partition import apply_plan
    from nnscaler.policies import make_plan

    register_op("* h -> * h")(SplitSTE)
    graph = capture(SplitNet(), {"x": torch.randn(4, 8)})
    program = apply_plan(graph, make_plan(graph, "tp", ComputeConfig(2, 2)))
    (ste,) = [s for s in program.statements if s.op.endswith("SplitSTE.apply")]
    assert program.local_meta[ste.outputs[0]].shape == (4, 8)  # half of the 16 features
