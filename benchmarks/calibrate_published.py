"""Fit the GEMM efficiency table (nnscaler/policies/autodist/gemm_efficiency.py) on the `calibrate` rows
of benchmarks/published_runs.yaml only, and print the fitted values and both splits' errors.

The free parameter is, per device kind with calibrate rows (a100, h100), `large` (the fraction of
peak big GEMMs sustain); `half_gflops` (the size of one call at which a GEMM sustains half of it) stays
at the table's kernel-measurement value unless --fit-half (the published runs' GEMMs are all large,
so they hardly constrain it: a free fit put it at 13 for the A100 and 0 for the H100).
A compute-bound matmul of F FLOPs takes (F + half) / (peak x large), so a row's step time is close to

    T(large, half) = A + (B + C x half) / large

(A: everything that is not matmul compute; the communication hidden behind compute makes this only
approximately true). Each calibrate row is costed three times to read off A, B and C (large 1 / half 0,
large 0.5 / half 0, large 1 / half 10); the fit minimises the calibrate rows' sum of squared
log(predicted / published) over a fine grid of (large, half) per kind; the rows are probed again around
that fit (x 0.9 on large, + 5 on half) and fitted once more, and the fitted table is costed for real
(every row, both splits) to check the closed form. Write the printed values into GEMM_TABLE by hand,
naming the fit in FIT_NOTE. Held-aside rows are only costed at the fitted values.

    python benchmarks/calibrate_published.py [--rows id,id]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from benchmarks.cost_model_vs_published import Captures, cost_row, predicted_figure, run_row, summary  # noqa: E402
from benchmarks.published_runs import load_rows  # noqa: E402
from nnscaler.policies.autodist.gemm_efficiency import GEMM_TABLE  # noqa: E402

OVERLAP_GRID = (0.0, 0.25, 0.5, 0.75, 0.9)


def _overlap(intra: float):
    from dataclasses import replace

    from nnscaler.policies.autodist.overlap import OverlapModel

    return replace(OverlapModel(), intra_node=intra)


LARGE_GRID = [0.40 + 0.005 * i for i in range(121)]  # 0.40 .. 1.00
HALF_GRID = [0.5 * i for i in range(61)]  # 0 .. 30 GFLOP


def _coefficients(
    run, captures: Captures, large: float = 1.0, half: float = 0.0, overlap=None
) -> tuple[float, float, float, int]:
    """(A, B, C) of the row's step time around (large, half), and its parameter count: costed at
    (large, half), (0.9 large, half) and (large, half + 5)."""
    graph, params = captures.get(run)
    probes = ((large, half), (0.9 * large, half), (large, half + 5.0))
    t1, t2, t3 = (
        cost_row(run, graph, {"matmul_efficiency": lg, "gemm_half_gflops": hf}, overlap)[0].step_time
        for lg, hf in probes
    )
    c_over_large = (t3 - t1) / 5.0  # C / large
    bc = (t2 - t1) / (1 / 0.9 - 1) * large  # B + C half
    c = c_over_large * large
    b = bc - c * half
    return t1 - bc / large, b, c, params


def _ratio(run, coef, large: float, half: float) -> float:
    a, b, c, params = coef
    step = a + (b + c * half) / large
    return predicted_figure(run, step, params) / run.published["value"]


def fit(runs, coefs, free_half: bool = False) -> dict[str, tuple[float, float]]:
    """Per device kind: the grid's (large, half) minimising the calibrate rows' squared log error; half
    kept at the table's (cuBLAS-derived) value unless `free_half`."""
    out = {}
    for kind in sorted({r.hardware["device"] for r in runs if r.split == "calibrate"}):
        rows = [r for r in runs if r.split == "calibrate" and r.hardware["device"] == kind]
        halves = HALF_GRID if free_half else [GEMM_TABLE[kind].half_gflops]
        best = min(
            (
                (sum(math.log(_ratio(r, coefs[r.id], lg, hf)) ** 2 for r in rows), lg, hf)
                for lg in LARGE_GRID
                for hf in halves
            ),
        )
        out[kind] = (round(best[1], 3), round(best[2], 1))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="", help="comma-separated row ids (default: all)")
    ap.add_argument(
        "--fit-half",
        action="store_true",
        help="fit half_gflops too (default: keep the table's, from kernel measurements: the published "
        "runs' GEMMs are all large and cannot tell it)",
    )
    ap.add_argument(
        "--fit-overlap",
        action="store_true",
        help="also fit OverlapModel.intra_node (how much of an NVLink collective hides behind compute) "
        f"over {OVERLAP_GRID}, on the calibrate rows; report only (overlap.py is not this script's)",
    )
    args = ap.parse_args()
    runs = load_rows()
    if args.rows:
        runs = [r for r in runs if r.id in args.rows.split(",")]
    runs.sort(key=lambda r: r.model_key)
    captures, t0 = Captures(), time.perf_counter()
    calib = [r for r in runs if r.split == "calibrate"]
    choices = [None] if not args.fit_overlap else [_overlap(x) for x in OVERLAP_GRID]
    best = None
    for overlap in choices:
        first = {r.id: _coefficients(r, captures, 0.7, 5.0, overlap) for r in calib}
        fitted = fit(calib, first, args.fit_half)
        coefs = {r.id: _coefficients(r, captures, *fitted[r.hardware["device"]], overlap) for r in calib}
        fitted = fit(calib, coefs, args.fit_half)
        loss = sum(math.log(_ratio(r, coefs[r.id], *fitted[r.hardware["device"]])) ** 2 for r in calib)
        line = {"intra_node_overlap": overlap.intra_node if overlap else "default", "loss": round(loss, 4)}
        print(json.dumps({**line, "fitted": fitted}), flush=True)
        if best is None or loss < best[0]:
            best = (loss, overlap, fitted, coefs)
    _, overlap, fitted, coefs = best
    print(json.dumps({"fitted": {k: {"large": v[0], "half_gflops": v[1]} for k, v in fitted.items()}}))
    if overlap is not None:
        print(json.dumps({"fitted_overlap": {"intra_node": overlap.intra_node}}))
    rows = []
    for run in runs:
        large, half = fitted.get(run.hardware["device"], (None, None))
        overrides = {} if large is None else {"matmul_efficiency": large, "gemm_half_gflops": half}
        row = run_row(run, captures, overrides, overlap)
        if run.id in coefs:
            row["closed_form_ratio"] = round(_ratio(run, coefs[run.id], large, half), 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    for line in summary(rows):
        print(json.dumps(line))
    print(json.dumps({"seconds": round(time.perf_counter() - t0, 1)}))


if __name__ == "__main__":
    main()
