"""An additive float mask that requires grad (ALiBi slopes, a learned relative-position bias) gets its
gradient from every context-parallel kind, equal to one-process SDPA's (float64, real gloo groups).

Each rank holds its query rows of the bias and all key columns; the gradient it gets back is of those
rows. Biases of shape (heads, s, s), broadcast over the batch, and (batch, heads, 1, s), one row
broadcast over the queries, which every rank holds whole: its gradient comes back as this rank's share
(a partial sum, as for any input the op reads whole while it is split; the compiler sums the shares).
Causal and not (the zigzag reorder moves the bias rows only when causal).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nnscaler.runtime.context_parallel import context_parallel_attention, hybrid_subgroups
from nnscaler.runtime.dist.groups import create_groups
from tests.dist_util import spawn

TOL = 1e-9
S, H, D, B = 16, 4, 4, 2


def _rows(t: torch.Tensor, n: int, r: int) -> torch.Tensor:
    if t.shape[-2] == 1:
        return t
    size = t.shape[-2] // n
    return t.narrow(-2, r * size, size)


def _inputs(seed: int, bias_shape: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    q, k, v, w = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(4))
    return q, k, v, w, torch.randn(*bias_shape, generator=g, dtype=torch.float64)


def _reference(q, k, v, w, bias, causal: bool) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
    q, k, v, bias = (t.clone().requires_grad_() for t in (q, k, v, bias))
    mask = bias
    if causal:
        mask = bias.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad, bias.grad


def _check(kind: str, u: int, bias_shape: tuple[int, ...], causal: bool, n: int, r: int, seed: int) -> float:
    q, k, v, w, bias = _inputs(seed, bias_shape)
    want = _reference(q, k, v, w, bias, causal)
    leaves = [_rows(t, n, r).clone().requires_grad_() for t in (q, k, v, bias)]
    out = context_parallel_attention(
        *leaves[:3],
        attn_mask=leaves[3],
        is_causal=causal,
        scale=0.3,
        group=dist.group.WORLD,
        kind=kind,
        ulysses_size=u,
    )
    (out * _rows(w, n, r)).sum().backward()
    got = [out.detach(), *(t.grad for t in leaves)]
    if bias_shape[-2] == 1 and got[4] is not None:  # one row, held by every rank: partial sums
        dist.all_reduce(got[4])
    worst = 0.0
    for name, g, ref in zip(("out", "dq", "dk", "dv", "dbias"), got, want):
        label = f"{kind} U={u} bias {bias_shape} causal={causal}: {name}"
        assert g is not None, f"{label}: no gradient"
        torch.testing.assert_close(
            g, _rows(ref, n, r), rtol=TOL, atol=TOL, msg=lambda m, label=label: f"{label}: {m}"
        )
        worst = max(worst, (g - _rows(ref, n, r)).abs().max().item())
    return worst


def _worker(rank: int, world_size: int) -> dict[str, float]:
    n = world_size
    create_groups([list(range(n))])
    kinds = [("ring", 1), ("zigzag", 1), ("ulysses", n)]
    if n == 4:
        create_groups(hybrid_subgroups(list(range(n)), 2))
        kinds.append(("hybrid", 2))
    errors = {}
    seed = 0
    for kind, u in kinds:
        for bias_shape in ((H, S, S), (B, H, 1, S)):
            for causal in (False, True):
                seed += 1
                errors[f"{kind} {bias_shape} {causal}"] = _check(kind, u, bias_shape, causal, n, rank, seed)
    return errors


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, 4])
def test_bias_gradient_matches_sdpa(tmp_path, world_size: int) -> None:  # noqa: ANN001
    reports = spawn(_worker, world_size, tmp_path, timeout=180)
    for report in reports:
        assert len(report) == (16 if world_size == 4 else 12)
        assert max(report.values()) < TOL
