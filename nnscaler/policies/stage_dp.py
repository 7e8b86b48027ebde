"""Pipeline stage boundaries by dynamic programming, the one loop every pipeline planner uses (the
`pp`/`hybrid` policies through stage_balance.py, autodist's pipeline search through its C++ twin,
autodist/_stage_dp.cpp, which runs the same loops with the same arithmetic).

Consecutive segments (runs of nodes between places a stage may start) are grouped into `nstages`
stages minimising the costliest stage, then, among splits as costly, the sum of squared stage costs
(so the stages that do not decide the maximum are balanced too). A stage costs its segments plus the
cost of the boundaries at its two ends (sending and receiving the activations that cross them); it
must fit `mem_limit` with 1F1B's micro-batches in flight (stage s keeps min(nstages - s, nmicros) of
them) and, where `seg_need` is given, hold at least one needed segment (one with weights).
"""

from __future__ import annotations

__all__ = ["stage_dp_py", "TIE"]

_INF = float("inf")
TIE = 1e-9
"""Stage costs within this relative distance count as equal (prefix sums round differently)."""


def stage_dp_py(
    seg_time: list[float],
    seg_act: list[float],
    seg_param: list[float],
    nstages: int,
    nmicros: int,
    mem_limit: float,
    seg_cross: list[float] | None = None,
    seg_need: list[int] | None = None,
) -> tuple[float, list[int]]:
    """(costliest stage, first segment of every stage); (inf, []) when no split is allowed.

    seg_cross[k]: the cost a boundary before segment k adds to each of the two stages it separates
    (seg_cross[0] is unused). seg_need[k]: 1 if segment k can make a stage worth a device."""
    n = len(seg_time)
    if nstages < 1 or nstages > n:
        return _INF, []
    cross = list(seg_cross) if seg_cross is not None else [0.0] * n
    need = list(seg_need) if seg_need is not None else [1] * n
    pt, pa, pp, pn = [0.0] * (n + 1), [0.0] * (n + 1), [0.0] * (n + 1), [0] * (n + 1)
    for i in range(n):
        pt[i + 1] = pt[i] + seg_time[i]
        pa[i + 1] = pa[i] + seg_act[i]
        pp[i + 1] = pp[i] + seg_param[i]
        pn[i + 1] = pn[i] + (1 if need[i] else 0)
    best = [[_INF] * (n + 1) for _ in range(nstages + 1)]
    square = [[_INF] * (n + 1) for _ in range(nstages + 1)]
    cut = [[-1] * (n + 1) for _ in range(nstages + 1)]
    best[0][0] = 0.0
    square[0][0] = 0.0
    for s in range(1, nstages + 1):
        inflight = min(nstages - (s - 1), nmicros)
        for j in range(s, n - (nstages - s) + 1):
            row = best[s]
            for i in range(s - 1, j):
                prev = best[s - 1][i]
                if prev == _INF or pn[j] - pn[i] == 0:
                    continue
                mem = (pp[j] - pp[i]) + (pa[j] - pa[i]) * inflight
                if mem > mem_limit:
                    continue
                t = pt[j] - pt[i]
                if i > 0:
                    t += cross[i]
                if j < n:
                    t += cross[j]
                v = prev if prev > t else t
                sq = square[s - 1][i] + t * t
                if v < row[j] * (1.0 - TIE) or (v <= row[j] * (1.0 + TIE) and sq < square[s][j]):
                    row[j] = v
                    square[s][j] = sq
                    cut[s][j] = i
    if best[nstages][n] == _INF:
        return _INF, []
    starts = [0] * nstages
    j = n
    for s in range(nstages, 0, -1):
        i = cut[s][j]
        starts[s - 1] = i
        j = i
    return best[nstages][n], starts
