"""Which frame of a stack is the user's code: the innermost outside torch, nnscaler, sympy, mpmath and
the standard library. Every capture message that names "the line" uses this one rule (a sympy frame
inside a slow shape guard is never the line to show)."""

from __future__ import annotations

import sysconfig
import traceback

__all__ = ["user_frame"]

_LIBRARY_PARTS = ("/torch/", "/nnscaler/", "/sympy/", "/mpmath/", "/functorch/")
_STDLIB = sysconfig.get_paths().get("stdlib", "\0")


def user_frame(frames: list[traceback.FrameSummary]) -> traceback.FrameSummary | None:
    """The innermost user frame of `frames` (outermost first, as traceback gives them); None if none."""
    for frame in reversed(frames):
        name = frame.filename.replace("\\", "/")
        stdlib = name.startswith(_STDLIB) and "-packages/" not in name
        if any(part in name for part in _LIBRARY_PARTS) or stdlib or name.startswith("<"):
            continue
        return frame
    return None
