"""Pipeline stage boundaries by dynamic programming (nnscaler.policies.stage_dp, the DP every
pipeline planner shares): split consecutive segments into stages, minimising the slowest stage while
every stage fits memory under 1F1B (stage s keeps the activations of min(nstages - s, nmicros)
micro-batches).

Here the loop is C++ (_stage_dp.cpp, built with pybind11 through cppimport on first use); without a
compiler (or with NNSCALER_AUTODIST_NATIVE=0) the pure-Python `stage_dp_py` runs: same loops, same
arithmetic, same answers (tests/compiler/test_autodist_pipeline.py checks it).
"""

from __future__ import annotations

import os
import warnings

from nnscaler import env_vars
from nnscaler.policies.stage_dp import stage_dp_py

__all__ = ["stage_dp", "stage_dp_py", "native_stage_dp", "native_available"]

_NATIVE: object = None


def native_stage_dp():
    """The compiled stage_dp, or None when it cannot be built here (no compiler, no pybind11)."""
    global _NATIVE
    if _NATIVE is None:
        _NATIVE = False
        if env_vars.read("NNSCALER_AUTODIST_NATIVE") is not False:
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
    seg_cross: list[float] | None = None,
    seg_need: list[int] | None = None,
) -> tuple[float, list[int]]:
    """stage_dp_py's answer, computed by the C++ loop where available."""
    fn = native_stage_dp()
    if fn is None:
        return stage_dp_py(seg_time, seg_act, seg_param, nstages, nmicros, mem_limit, seg_cross, seg_need)
    t, starts = fn(
        list(seg_time),
        list(seg_act),
        list(seg_param),
        nstages,
        nmicros,
        float(mem_limit),
        [float(x) for x in seg_cross] if seg_cross is not None else [],
        [1 if x else 0 for x in seg_need] if seg_need is not None else [],
    )
    return t, list(starts)
