"""The report's predicted speed-ups carry the cost model's error band on published runs (issue 42)."""

from nnscaler.policies.autodist.model_error import PUBLISHED_ERROR, ModelError, speedup_words

BAND = ModelError(median=0.08, worst=0.18, rows=6, source="the table")


def test_a_gain_inside_the_worst_error_is_not_called_established():
    words = speedup_words(1.0, 1.10, "DP x8 + ZeRO-1", BAND)
    assert words.startswith("Predicted 10% faster than DP x8 + ZeRO-1")
    assert "within the model's error band" in words and "measure both" in words
    assert "8% median, 18% worst (6 runs" in words


def test_a_gain_beyond_it_is_said_to_be_outside_the_band():
    words = speedup_words(1.0, 1.5, "Megatron TP8", BAND)
    assert words.startswith("Predicted 50% faster") and "outside the model's error band" in words
    assert speedup_words(1.0, 0.8, "r", BAND).startswith("Predicted 20% slower than r")


def test_the_shipped_band_names_its_source():
    assert 0 < PUBLISHED_ERROR.median <= PUBLISHED_ERROR.worst
    assert "published_runs.yaml" in PUBLISHED_ERROR.source
