"""Expert parallelism sends the minimum through all-to-all (benchmarks/moe_alltoall_bytes.py counts it
on a compiled Mixtral; here the experts' runtime is called directly with routing chosen to be balanced,
skewed at random, and all on one rank's experts).

Per rank, MoE layer and direction (forward, backward), the hidden-row payload is exactly
(T x k + R_r) x H x dtype bytes: its own T x k assignments out, the outputs of the R_r assignments its
experts received back (backward retraces the same rows); over the ep group's ranks the mean is the
issue's minimum 2 x T x k x H x dtype bytes, and the only other traffic is the forward's count exchange
of ep x (E / ep + 1) int64s. ep 4 over all four ranks, ep 2 over {0, 1} and {2, 3}.
"""

from __future__ import annotations

import torch

from benchmarks.moe_alltoall_bytes import AllToAllCounter, layer_bytes
from nnscaler.runtime.dist.groups import create_groups, get_group
from nnscaler.runtime.moe import expert_parallel_experts, local_experts

try:
    from .dist_util import run_dist
except ImportError:
    from dist_util import run_dist

T, H, INNER, E, K = 16, 8, 12, 8, 2
"""Tokens per rank, hidden size, expert intermediate size, experts, experts per token."""
ROUTINGS = ("balanced", "skewed", "one_rank")


def _routing(kind: str, source: int) -> torch.Tensor:
    """[T, K] experts of the tokens of `source` (rank in its ep group): every expert equally often, a
    random preference for low experts, or experts 0 and 1 only (the first rank's, for ep 2 and 4)."""
    if kind == "balanced":
        t = torch.arange(T)
        return torch.stack([(t + source) % E, (t + source + E // 2) % E], dim=1)
    if kind == "one_rank":
        return torch.tensor([[0, 1]] * T)
    g = torch.Generator().manual_seed(100 + source)
    probs = torch.tensor([8.0, 6, 4, 3, 1, 1, 0.5, 0.5])
    return torch.stack([torch.multinomial(probs, K, generator=g) for _ in range(T)])


def _run(kind: str, ranks: list[int], me: int) -> dict:
    """One MoE layer over the ep group `ranks`: counted bytes, and the output against one device."""
    ep, local = len(ranks), E // len(ranks)
    g = torch.Generator().manual_seed(7)
    gate_up, down = torch.randn(E, 2 * INNER, H, generator=g), torch.randn(E, H, INNER, generator=g)
    hidden = torch.randn(T, H, generator=torch.Generator().manual_seed(me)).requires_grad_()
    index = _routing(kind, me)
    weights = torch.rand(T, K, generator=torch.Generator().manual_seed(50 + me))
    mine = slice(me * local, (me + 1) * local)
    w1, w2 = (w[mine].clone().requires_grad_() for w in (gate_up, down))
    with AllToAllCounter() as counter:
        out = expert_parallel_experts(hidden, index, weights, w1, w2, "silu", group=get_group(ranks))
        counter.phase = "backward"
        out.sum().backward()
    want = local_experts(hidden.detach(), index, weights, gate_up, down, "silu")
    torch.testing.assert_close(out.detach(), want, msg=lambda m: f"{kind}, ep {ep}: output differs: {m}")
    received = sum(int(((_routing(kind, s) // local) == me).sum()) for s in range(ep))
    stays = int(((index // local) == me).sum())
    return {"layer": layer_bytes(counter.calls, 1)[0], "received": received, "stays": stays}


def bytes_worker(rank: int, world: int) -> dict:
    create_groups([[0, 1], [2, 3], [0, 1, 2, 3]])
    out = {}
    for ranks in ([0, 1, 2, 3], [0, 1] if rank < 2 else [2, 3]):
        for kind in ROUTINGS:
            out[(len(ranks), kind)] = _run(kind, ranks, ranks.index(rank))
    return out


def test_alltoall_payload_is_the_minimum_for_balanced_and_skewed_routing():
    results = run_dist(bytes_worker, 4, timeout=120)
    row = H * 4  # float32 rows
    minimum = 2 * T * K * row
    for ep in (4, 2):
        for kind in ROUTINGS:
            cells = [results[r][(ep, kind)] for r in range(4)]
            where = f"{kind} routing, ep {ep}"
            received = [c["received"] for c in cells]
            if kind == "one_rank":
                assert received[0] == ep * T * K and not any(received[1:ep]), (where, received)
            if kind == "balanced":
                assert received == [T * K] * 4, (where, received)
            for r, c in enumerate(cells):
                exact = (T * K + c["received"]) * row
                off_rank = (T * K + c["received"] - 2 * c["stays"]) * row
                for phase in ("forward", "backward"):
                    got = c["layer"][phase]
                    assert got["payload_bytes"] == exact, f"{where}, rank {r}, {phase}: {got} vs {exact}"
                    assert got["off_rank_bytes"] == off_rank, f"{where}, rank {r}, {phase}: {got}"
                counts = c["layer"]["forward"]["count_bytes"]
                assert counts == ep * (E // ep + 1) * 8, f"{where}, rank {r}: count exchange {counts} bytes"
                assert c["layer"]["backward"]["count_bytes"] == 0
            for phase in ("forward", "backward"):
                mean = sum(c["layer"][phase]["payload_bytes"] for c in cells) / 4
                assert mean == minimum, f"{where}, {phase}: mean payload {mean} != minimum {minimum}"
