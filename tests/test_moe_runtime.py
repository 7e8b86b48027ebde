"""nnscaler.runtime.moe: the experts op against the models' own experts and a naive loop, the
capacity rule, and expert parallelism over gloo against one device (values, gradients, the
collectives each rank issues, and the router's choices inside a compiled model)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from nnscaler.runtime.moe import capacity, expert_parallel_experts, local_experts
from tests.dist_util import spawn

T, H, INNER, E, K = 24, 8, 6, 8, 2


def _inputs(seed: int = 0, skew: bool = False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    logits = torch.randn(T, E, generator=g)
    if skew:  # experts 0 and 1 get most tokens, experts 6 and 7 none: capacity drops, ranks idle
        logits[:, :2] += 4.0
        logits[:, 6:] -= 100.0
    w, idx = logits.softmax(-1).topk(K, dim=-1)
    gate_up = torch.randn(E, 2 * INNER, H, generator=g) * 0.3
    down = torch.randn(E, H, INNER, generator=g) * 0.3
    return x, idx, w, gate_up, down


def _naive(x, idx, w, gate_up, down, limit=None):
    """Per (token, slot) in token order; an expert's assignments beyond `limit` add nothing."""
    out = torch.zeros_like(x)
    seen = [0] * E
    for t in range(x.shape[0]):
        for s in range(idx.shape[1]):
            e = int(idx[t, s])
            seen[e] += 1
            if limit is not None and seen[e] > limit:
                continue
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += w[t, s] * (down[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("factor", [None, 0.5])
def test_local_experts_matches_a_naive_loop(factor):
    x, idx, w, gate_up, down = _inputs(skew=True)
    limit = None if factor is None else capacity(T, K, E, factor)
    got = local_experts(x, idx, w, gate_up, down, "silu", factor)
    torch.testing.assert_close(got, _naive(x, idx, w, gate_up, down, limit), rtol=1e-5, atol=1e-6)
    if factor is not None:  # the rule dropped something, so the dropless result differs
        assert not torch.allclose(got, local_experts(x, idx, w, gate_up, down, "silu"))


def test_capacity_rule_and_refusal():
    assert capacity(24, 2, 8, 1.0) == 6 and capacity(10, 2, 4, 1.25) == 7
    with pytest.raises(ValueError, match="capacity_factor must be > 0"):
        capacity(24, 2, 8, 0.0)


def test_op_backward_matches_autograd_through_the_loop():
    from nnscaler.runtime.moe import moe_experts

    x, idx, w, gate_up, down = (t.requires_grad_(t.is_floating_point()) for t in _inputs(1))
    grads = torch.autograd.grad(moe_experts(x, idx, w, gate_up, down, "silu").sum(), (x, w, gate_up, down))
    ref = torch.autograd.grad(_naive(x, idx, w, gate_up, down).sum(), (x, w, gate_up, down))
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _ep_worker(rank: int, world: int, factor, skew: bool) -> dict:
    x, idx, w, gate_up, down = _inputs(2, skew)
    rows = T // world
    local = E // world
    calls = []
    real = dist.all_to_all_single

    def logged(out, inp, out_splits=None, in_splits=None, group=None):
        calls.append(("all_to_all_single", tuple(inp.shape[1:]), inp.dtype))
        return real(out, inp, out_splits, in_splits, group=group)

    mine = [
        t[rank * rows : (rank + 1) * rows].clone().requires_grad_(t.is_floating_point()) for t in (x, idx, w)
    ]
    weights = [t[rank * local : (rank + 1) * local].clone().requires_grad_() for t in (gate_up, down)]
    dist.all_to_all_single = logged
    try:
        out = expert_parallel_experts(*mine, *weights, "silu", factor, group=dist.group.WORLD)
        (out * torch.arange(1.0, H + 1)).sum().backward()
    finally:
        dist.all_to_all_single = real
    return {
        "out": out.detach(),
        "grads": [mine[0].grad, mine[2].grad, weights[0].grad, weights[1].grad],
        "calls": calls,
    }


@pytest.mark.parametrize("factor,skew", [(None, False), (None, True), (0.75, True)])
def test_expert_parallel_matches_one_device(tmp_path, factor, skew):
    world = 4
    results = spawn(_ep_worker, world, tmp_path, factor, skew, timeout=120)
    x, idx, w, gate_up, down = (t.requires_grad_(t.is_floating_point()) for t in _inputs(2, skew))
    out = local_experts(x, idx, w, gate_up, down, "silu", factor)
    (out * torch.arange(1.0, H + 1)).sum().backward()
    torch.testing.assert_close(torch.cat([r["out"] for r in results]), out.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([r["grads"][0] for r in results]), x.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.cat([r["grads"][1] for r in results]), w.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        torch.cat([r["grads"][2] for r in results]), gate_up.grad, rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(torch.cat([r["grads"][3] for r in results]), down.grad, rtol=1e-5, atol=1e-5)
    # every rank issues the same collectives in the same order (NCCL's rule), idle ranks too:
    # counts, dispatch, return; backward: the two reverse all-to-alls
    assert len({tuple(r["calls"]) for r in results}) == 1
    assert len(results[0]["calls"]) == 5
