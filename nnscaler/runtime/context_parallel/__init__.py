"""Context-parallel attention: scaled dot-product attention with the sequence split over ranks.

Generated code calls `context_parallel_attention(q, k, v, ..., group=..., kind=...)` in place of
`F.scaled_dot_product_attention`. Kinds (`CP_KINDS`): "zigzag", "ring", "ulysses", "hybrid". The
compiler reads `hybrid_subgroups` (process groups to create at init) and `ring_p2p_steps` (the
ring's point-to-point order, for its NCCL simulator). See docs/context_parallel.md.

Modules: `layout` (who holds which rows), `blocks` (block attention, log-sum-exp merge, block
backward), `schedule` (the ring's P2P order), `ring`, `zigzag` (reorders), `ulysses`, `hybrid`
(the composition every kind runs), `dispatch` (the public function and its checks).
"""

from nnscaler.runtime.context_parallel.dispatch import context_parallel_attention
from nnscaler.runtime.context_parallel.hybrid import hybrid_subgroups
from nnscaler.runtime.context_parallel.schedule import CP_KINDS, ring_p2p_steps

__all__ = ["context_parallel_attention", "hybrid_subgroups", "ring_p2p_steps", "CP_KINDS"]
