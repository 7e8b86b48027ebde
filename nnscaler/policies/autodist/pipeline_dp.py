"""Pipeline stage boundaries by dynamic programming: split consecutive segments (layers at pivots)
into stages, minimising the slowest stage while every stage fits memory under 1F1B (stage s keeps
the activations of min(nstages - s, nmicros) micro-batches).

The loop is C++ (_stage_dp.cpp, built with pybind11 through cppimport on first use); without a
compiler (or with NNSCALER_AUTODIST_NATIVE=0) the pure-Python `stage_dp_py` runs: same loops, same
arithmetic, same answers (tests/compiler/test_autodist_pipeline.py checks it).
"""

from __future__ import annotations

import os
import warnings

__all__ = ["stage_dp", "stage_dp_py", "native_stage_dp", "native_available"]

_INF = float("inf")
_NATIVE: object = None


def stage_dp_py(
    seg_time: list[float],
    seg_act: list[float],
    seg_param: list[float],
    nstages: int,
    nmicros: int,
    mem_limit: float,
) -> tuple[float, list[int]]:
    """(slowest stage time, first segment of every stage); (inf, []) when nothing fits."""
    n = len(seg_time)
    if nstages < 1 or nstages > n:
        return _INF, []
    pt, pa, pp = [0.0] * (n + 1), [0.0] * (n + 1), [0.0] * (n + 1)
    for i in range(n):
        pt[i + 1] = pt[i] + seg_time[i]
        pa[i + 1] = pa[i] + seg_act[i]
        pp[i + 1] = pp[i] + seg_param[i]
    best = [[_INF] * (n + 1) for _ in range(nstages + 1)]
    cut = [[-1] * (n + 1) for _ in range(nstages + 1)]
    best[0][0] = 0.0
    for s in range(1, nstages + 1):
        inflight = min(nstages - (s - 1), nmicros)
        for j in range(s, n - (nstages - s) + 1):
            row_prev, row = best[s - 1], best[s]
            for i in range(s - 1, j):
                prev = row_prev[i]
                if prev == _INF:
                    continue
                mem = (pp[j] - pp[i]) + (pa[j] - pa[i]) * inflight
                if mem > mem_limit:
                    continue
                t = pt[j] - pt[i]
                v = prev if prev > t else t
                if v < row[j]:
                    row[j] = v
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


def native_stage_dp():
    """The compiled stage_dp, or None when it cannot be built here (no compiler, no pybind11)."""
    global _NATIVE
    if _NATIVE is None:
        _NATIVE = False
        if os.environ.get("NNSCALER_AUTODIST_NATIVE", "1") != "0":
            try:
                import cppimport

                # by file, not by module name: cppimport's name lookup walks sys.path directories,
                # which an editable install (a path hook) does not put there
                source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_stage_dp.cpp")
                _NATIVE = cppimport.imp_from_filepath(source, "nnscaler.policies.autodist._stage_dp").stage_dp
            except Exception as exc:  # no compiler / headers: the Python loop gives the same answers
                warnings.warn(
                    f"autodist: C++ pipeline DP unavailable ({exc}); using the Python loop", stacklevel=2
                )
    return _NATIVE or None


def native_available() -> bool:
    return native_stage_dp() is not None


def stage_dp(
    seg_time: list[float],
    seg_act: list[float],
    seg_param: list[float],
    nstages: int,
    nmicros: int,
    mem_limit: float,
) -> tuple[float, list[int]]:
    """stage_dp_py's answer, computed by the C++ loop where available."""
    fn = native_stage_dp()
    if fn is None:
        return stage_dp_py(seg_time, seg_act, seg_param, nstages, nmicros, mem_limit)
    t, starts = fn(list(seg_time), list(seg_act), list(seg_param), nstages, nmicros, float(mem_limit))
    return t, list(starts)
