"""Embedding lookups: split the vocabulary (vocab-parallel, partial sums), the hidden dim, or the batch."""

from __future__ import annotations

from nnscaler.graph.ops.registry import Special, fixed

fixed(
    "aten.embedding.default",
    "embedding",
    "v+ d, * -> * d",
    specials={"v": Special("vocab_parallel_embedding")},
)
