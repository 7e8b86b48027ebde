"""How far the cost model's step times were from measured ones: the band every predicted comparison in
the report carries. The figures come from `benchmarks/cost_model_vs_published.py` on the held-aside
rows of `benchmarks/published_runs.yaml` (published training runs the model was not fitted to); update
them when either changes."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelError", "PUBLISHED_ERROR", "speedup_words"]


@dataclass(frozen=True)
class ModelError:
    """Relative error of predicted against measured throughput over a set of runs."""

    median: float
    worst: float
    rows: int
    source: str


PUBLISHED_ERROR = ModelError(
    median=0.056,
    worst=0.287,
    rows=8,
    source="benchmarks/cost_model_vs_published.py, held-aside rows of benchmarks/published_runs.yaml",
)
"""The model's error on published runs it was not calibrated on."""


def speedup_words(ours: float, theirs: float, name: str, error: ModelError = PUBLISHED_ERROR) -> str:
    """One sentence comparing two predicted step times with the model's error band: a difference inside
    the worst error is called a prediction, not an established speed-up."""
    if ours <= 0 or theirs <= 0:
        return ""
    gain = theirs / ours - 1.0
    band = (
        f"the cost model's error against published runs is {error.median:.0%} median, "
        f"{error.worst:.0%} worst ({error.rows} runs it was not fitted to; {error.source})"
    )
    if gain >= 0:
        claim = f"Predicted {gain:.0%} faster than {name}"
    else:
        claim = f"Predicted {-gain:.0%} slower than {name}"
    if abs(gain) <= error.worst:
        return f"{claim}; within the model's error band ({band}), so measure both before relying on it."
    return f"{claim}; outside the model's error band ({band})."
