"""Context-parallel attention on real gloo groups: every kind's output rows and q/k/v gradients
against one-process SDPA in float64, a bfloat16 smoke, bad calls refused, the ring's P2P order
against `ring_p2p_steps`, and the memory saved for backward scaling as S/N."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from nnscaler.runtime.context_parallel import (
    CP_KINDS,
    context_parallel_attention,
    hybrid_subgroups,
    ring_p2p_steps,
)
from nnscaler.runtime.context_parallel.layout import block_pairs, ring_layout
from nnscaler.runtime.context_parallel.ring import RingSpec, ring_attention
from nnscaler.runtime.dist.groups import create_groups
from tests.dist_util import spawn

TOL = 1e-9


@dataclass(frozen=True)
class Case:
    kind: str
    s: int = 32
    hq: int = 4
    hkv: int = 4
    d: int = 4
    e: int = 6
    batch: tuple[int, ...] = (2,)
    causal: bool = False
    mask: str = "none"
    """"none", "doc:5,11,16" (bool block-diagonal causal from position_ids), "float" (per head),
    "pad" (bool key padding, one row)."""
    ulysses_size: int = 1

    def __str__(self) -> str:
        u = f" U={self.ulysses_size}" if self.kind == "hybrid" else ""
        return f"{self.kind}{u} S={self.s} H={self.hq}/{self.hkv} causal={self.causal} mask={self.mask}"


def doc_mask(lengths: list[int]) -> torch.Tensor:
    """The block-diagonal causal mask (S, S) that position_ids restarting at each document make."""
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    doc = torch.cumsum(position_ids == 0, 0)
    same = doc[:, None] == doc[None, :]
    return same & torch.ones(len(doc), len(doc), dtype=torch.bool).tril()


def _inputs(case: Case, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    b, s = case.batch, case.s
    q = torch.randn(*b, case.hq, s, case.d, generator=g, dtype=torch.float64)
    k = torch.randn(*b, case.hkv, s, case.d, generator=g, dtype=torch.float64)
    v = torch.randn(*b, case.hkv, s, case.e, generator=g, dtype=torch.float64)
    w = torch.randn(*b, case.hq, s, case.e, generator=g, dtype=torch.float64)
    mask = None
    if case.mask.startswith("doc:"):
        mask = doc_mask([int(x) for x in case.mask[4:].split(",")])
    elif case.mask == "float":
        mask = torch.randn(case.hq, s, s, generator=g, dtype=torch.float64)
    elif case.mask == "pad":
        mask = torch.rand(*b, 1, 1, s, generator=g) > 0.3
        mask[..., 0] = True
    return q, k, v, w, mask


def _reference(case: Case, q, k, v, w, mask) -> tuple[torch.Tensor, ...]:  # noqa: ANN001
    """Full-sequence SDPA (a causal flag folded into the mask: torch refuses both at once)."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    causal = case.causal
    if mask is not None and causal:
        tril = torch.ones(case.s, case.s, dtype=torch.bool).tril()
        mask = mask & tril if mask.dtype == torch.bool else mask.masked_fill(~tril, float("-inf"))
        causal = False
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=case.hq != case.hkv
    )
    (out * w).sum().backward()
    return out.detach(), q.grad, k.grad, v.grad


def _rows(t: torch.Tensor | None, n: int, r: int) -> torch.Tensor | None:
    if t is None or t.shape[-2] == 1:
        return t
    size = t.shape[-2] // n
    return t.narrow(-2, r * size, size)


def _run_local(case: Case, group, n: int, r: int, data, dtype=torch.float64):  # noqa: ANN001
    q, k, v, w, mask = data
    leaves = [_rows(t, n, r).to(dtype).detach().requires_grad_() for t in (q, k, v)]
    local_mask = _rows(mask, n, r)
    if local_mask is not None and local_mask.is_floating_point():
        local_mask = local_mask.to(dtype)
    out = context_parallel_attention(
        *leaves,
        attn_mask=local_mask,
        is_causal=case.causal,
        enable_gqa=case.hq != case.hkv,
        group=group,
        kind=case.kind,
        ulysses_size=case.ulysses_size,
    )
    (out.double() * _rows(w, n, r)).sum().backward()
    return out.detach(), *(t.grad for t in leaves)


def check_case(case: Case, group, n: int, r: int, seed: int) -> float:  # noqa: ANN001
    """This rank's output rows and q/k/v gradient rows against the reference; the largest error."""
    data = _inputs(case, seed)
    want = [_rows(t, n, r) for t in _reference(case, *data)]
    got = _run_local(case, group, n, r, data)
    worst = 0.0
    for name, g, ref in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == torch.float64 and g.shape == ref.shape, f"{case}: {name} {g.shape} vs {ref.shape}"
        torch.testing.assert_close(
            g, ref, rtol=TOL, atol=TOL, msg=lambda m, name=name: f"{case}: {name}: {m}"
        )
        worst = max(worst, (g - ref).abs().max().item())
    return worst


def _cases(n: int) -> list[Case]:
    kinds = [Case("ring"), Case("zigzag"), Case("ulysses"), Case("hybrid", ulysses_size=2)]
    if n == 2:
        kinds.append(Case("hybrid", ulysses_size=1))
    out = []
    for base in kinds:
        for causal in (False, True):
            out.append(replace(base, causal=causal))
            out.append(replace(base, causal=causal, hq=8, hkv=2, mask="float"))
        out.append(replace(base, mask="doc:5,11,16"))
        out.append(replace(base, mask="doc:5,11,16", causal=True, hq=8, hkv=2, batch=()))
        out.append(replace(base, s=64, mask="doc:3,20,1,33,7", hq=4, hkv=1))
        out.append(replace(base, s=64, causal=True, mask="pad"))
    out += [
        Case("zigzag", s=1024, hq=2, hkv=2, d=8, e=8, batch=(1,), causal=True),
        Case("ring", s=1024, hq=2, hkv=1, d=8, e=8, batch=(1,), causal=True, mask="doc:100,300,624"),
        Case("hybrid", s=1024, hq=4, hkv=2, d=8, e=8, batch=(1,), causal=True, ulysses_size=2),
    ]
    return out


def _groups(n: int) -> None:
    create_groups([list(range(n))])
    if n == 4:
        create_groups(hybrid_subgroups(list(range(n)), 2))


def check_bf16(group, n: int, r: int) -> float:  # noqa: ANN001
    """bfloat16 inputs against the float32 reference of the same (rounded) inputs."""
    case = Case(
        "hybrid" if n == 4 else "zigzag", s=64, hq=8, hkv=2, causal=True, mask="doc:10,30,24", ulysses_size=2
    )
    q, k, v, w, mask = _inputs(case, 7)
    q, k, v = (t.to(torch.bfloat16).double() for t in (q, k, v))
    want = [_rows(t, n, r) for t in _reference(case, q, k, v, w, mask)]
    got = _run_local(case, group, n, r, (q, k, v, w, mask), dtype=torch.bfloat16)
    rel = 0.0
    for name, g, ref in zip(("out", "dq", "dk", "dv"), got, want):
        assert g.dtype == torch.bfloat16, f"bf16 {name} came back as {g.dtype}"
        err = ((g.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 2e-2, f"bf16 {name}: relative error {err:.3g}"
        rel = max(rel, err)
    return rel


def check_refusals(group, n: int) -> list[str]:  # noqa: ANN001
    q = torch.randn(1, 3, 8, 4)
    seen = []
    bad = [
        (
            dict(dropout_p=0.1),
            q,
            "dropout_p=0.1 is not supported under context parallelism: set the attention",
        ),
        (dict(kind="ulysses"), q, f"3 query heads over {n} ranks"),
        (dict(kind="hybrid", ulysses_size=3), q, f"ulysses_size=3 must divide the group size {n}"),
        (dict(kind="zigzag", is_causal=True), torch.randn(1, 4, 3, 4), f"must be divisible by {2 * n}"),
        (dict(kind="tree"), q, "kind must be one of"),
        (dict(attn_mask=torch.ones(8, 8, dtype=torch.bool)), q, f"all {8 * n} columns"),
    ]
    for kwargs, x, match in bad:
        try:
            context_parallel_attention(x, x, x, group=group, **kwargs)
        except ValueError as e:
            assert match in str(e), f"{kwargs}: message {e!s} lacks {match!r}"
            seen.append(str(e))
        else:
            raise AssertionError(f"{kwargs} was accepted")
    return seen


def check_p2p_order(group, n: int, r: int) -> dict[str, int]:  # noqa: ANN001
    """Record the kernels' batch_isend_irecv calls; they must be exactly `ring_p2p_steps`."""
    original, calls = dist.batch_isend_irecv, []

    def recording(ops):  # noqa: ANN001, ANN202
        calls.append([("send" if op.op is dist.isend else "recv", op.peer) for op in ops])
        return original(ops)

    counts = {}
    dist.batch_isend_irecv = recording
    try:
        for kind, u in [("ring", 1), ("zigzag", 1), ("ulysses", n), ("hybrid", 2)]:
            calls.clear()
            check_case(Case(kind, causal=True, ulysses_size=u), group, n, r, seed=3)
            got = [(op, peer, step) for step, ops in enumerate(calls) for op, peer in ops]
            assert got == ring_p2p_steps(n, kind, u)[r], f"{kind}: kernel issued {got}"
            counts[kind] = len(calls)
    finally:
        dist.batch_isend_irecv = original
    return counts


def saved_bytes(fn) -> int:  # noqa: ANN001
    """Bytes autograd saves for backward while `fn()` runs (every saved tensor, once per save)."""
    total = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


MEM_CASE = Case("ring", s=256, hq=4, hkv=4, d=16, e=16, batch=(1,), causal=True, mask="doc:100,156")


def _memory_call(kind: str, group, n: int, r: int) -> int:  # noqa: ANN001
    q, k, v, _, mask = _inputs(MEM_CASE, 5)
    q, k, v = (_rows(t, n, r).float().requires_grad_() for t in (q, k, v))

    def run() -> None:
        context_parallel_attention(q, k, v, _rows(mask, n, r), is_causal=True, group=group, kind=kind)

    return saved_bytes(run)


def worker(rank: int, world_size: int) -> dict:
    n, r = world_size, rank
    _groups(n)
    group = dist.group.WORLD
    start = time.perf_counter()
    errors = {str(case): check_case(case, group, n, r, seed=i) for i, case in enumerate(_cases(n))}
    report = {"errors": errors, "cases_s": time.perf_counter() - start}
    report["bf16_rel_error"] = check_bf16(group, n, r)
    report["refusals"] = check_refusals(group, n)
    report["batches"] = check_p2p_order(group, n, r)
    if n == 4:
        report["saved"] = {kind: _memory_call(kind, group, n, r) for kind in ("ring", "zigzag")}
    return report


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_attention_matches_sdpa(tmp_path, world_size: int) -> None:  # noqa: ANN001
    reports = spawn(worker, world_size, tmp_path, timeout=180)
    cases = _cases(world_size)
    for rep in reports:
        assert set(rep["errors"]) == {str(c) for c in cases}
        assert max(rep["errors"].values()) < TOL
        assert rep["bf16_rel_error"] < 2e-2
        assert len(rep["refusals"]) == 6
    n = world_size
    # a ring of R > 1 positions: forward R-1 batches, backward 2R-1; hybrid rings over n/2 positions
    assert reports[0]["batches"] == {
        "ring": 3 * n - 2,
        "zigzag": 3 * n - 2,
        "ulysses": 0,
        "hybrid": 3 * (n // 2) - 2 if n > 2 else 0,
    }
    if world_size == 4:
        # what one rank of 4 saves for backward is a quarter of what the one-rank ring saves
        one = saved_bytes(_one_rank_ring)
        for kind in ("ring", "zigzag"):
            per_rank = [rep["saved"][kind] for rep in reports]
            assert len(set(per_rank)) == 1, f"{kind}: ranks save different amounts {per_rank}"
            assert per_rank[0] * 4 == one, f"{kind}: a rank of 4 saves {per_rank[0]} B, one rank {one} B"


def _one_rank_ring() -> None:
    q, k, v, _, mask = _inputs(MEM_CASE, 5)
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    ring_attention(q, k, v, mask, RingSpec(None, ring_layout(MEM_CASE.s, 1, False), True, 0.25))


def test_single_rank_is_sdpa() -> None:
    case = Case("zigzag", causal=True, hq=8, hkv=2)
    q, k, v, w, _ = _inputs(case, 0)
    got = context_parallel_attention(q, k, v, is_causal=True, enable_gqa=True, group=None)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.equal(got, want)


def _work(layout, pos: int, n: int, causal: bool) -> list[int]:  # noqa: ANN001
    """Score elements rank `pos` computes at each ring step."""
    out = []
    for t in range(n):
        pairs = block_pairs(layout[pos], layout[(pos - t) % n], causal)
        out.append(sum(p.q_global[1] * sum(length for _, length in p.kv_global) for p in pairs))
    return out


def test_zigzag_balances_the_causal_ring_and_contiguous_does_not() -> None:
    n, s = 4, 64
    zig = [sum(_work(ring_layout(s, n, True), p, n, True)) for p in range(n)]
    contiguous = [sum(_work(ring_layout(s, n, False), p, n, True)) for p in range(n)]
    assert len(set(zig)) == 1, zig
    assert contiguous == sorted(contiguous) and contiguous[-1] == 4 * contiguous[0], contiguous
    full = sum(_work(ring_layout(s, n, False), 0, n, False))
    assert full == (s // n) * s  # non-causal: every key of every block


def test_schedule_pairs_every_send_with_a_receive() -> None:
    for n, kind, u in [
        (2, "ring", 1),
        (4, "zigzag", 1),
        (8, "hybrid", 2),
        (8, "hybrid", 4),
        (4, "ulysses", 1),
    ]:
        steps = ring_p2p_steps(n, kind, u)
        for a in range(n):
            for b in range(n):
                sent = [s for op, peer, s in steps[a] if op == "send" and peer == b]
                got = [s for op, peer, s in steps[b] if op == "recv" and peer == a]
                assert sent == got, f"{kind} n={n} U={u}: {a}->{b} sends {sent}, receives {got}"
    assert ring_p2p_steps(4, "ulysses") == [[], [], [], []]
    assert ring_p2p_steps(3, "ring", phase="forward")[0] == [
        ("send", 1, 0),
        ("recv", 2, 0),
        ("send", 1, 1),
        ("recv", 2, 1),
    ]
    with pytest.raises(ValueError, match="kind must be one of"):
        ring_p2p_steps(4, "tree")
    assert set(CP_KINDS) == {"zigzag", "ring", "ulysses", "hybrid"}


def test_hybrid_subgroups() -> None:
    assert hybrid_subgroups([7, 3, 5, 1], 2) == [[1, 3], [5, 7], [1, 5], [3, 7]]
    assert hybrid_subgroups([0, 1, 2, 3, 4, 5], 3) == [[0, 1, 2], [3, 4, 5], [0, 3], [1, 4], [2, 5]]
    with pytest.raises(ValueError, match="ulysses_size=4 must divide the context-parallel group size 6"):
        hybrid_subgroups(list(range(6)), 4)
