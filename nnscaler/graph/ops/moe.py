"""Mixture-of-experts kernels: grouped matmuls over tokens sorted by expert, and whole experts layers.

`grouped_mm(x [tokens, k], w [experts, k, n], offsets [experts])`: tokens stay whole (the offsets
index them); the experts' output features split (column-parallel) or their input features
(row-parallel, partial sums), as for a linear layer.

`nnscaler.moe_experts(hidden [t, h], top_k_index [t, k], top_k_weights [t, k], gate_up [e, 2i, h],
down [e, h, i])` (nnscaler.runtime.moe; capture makes it from a recognised experts module, see
graph/capture/moe.py): split by tokens (each device all experts, its tokens), by the experts'
intermediate features `i` (partial sums, as a column- then row-parallel MLP), or on the expert dim
`e` through its special, expert parallelism: each device holds E / n experts and its own tokens
(`co_split` on `t`), and all-to-alls carry the tokens to their experts and back. `e` stays `^`:
a plain split would leave tokens without their experts.
"""

from __future__ import annotations

from nnscaler.graph.ops._letters import letters
from nnscaler.graph.ops.registry import OpCall, Special, fixed, rule

EXPERT_PARALLEL = "expert_parallel_experts"
MOE_EXPERTS_OP = "nnscaler.moe_experts.default"


@rule(["transformers.grouped_mm_fallback.default", "aten._grouped_mm.default"], "moe")
def grouped_mm(call: OpCall) -> str:
    ins = ["t^ k+", "e^ k+ n"] + ["e^"] * (len(call.inputs) - 2)
    return ", ".join(ins) + " -> t^ n"


fixed(
    MOE_EXPERTS_OP,
    "moe",
    "t h^, t k^, t k^, e^ (2 i) h^, e^ h^ i+ -> t h^",
    specials={"e": Special(EXPERT_PARALLEL, splits_fixed=True, co_split="t")},
)


def _along(call: OpCall, dim: int, tensors: int, outputs: int) -> str:
    """Rows independent along every dim but `dim`: `tensors` inputs and `outputs` outputs of one
    rank, whose `dim` is whole (sizes may differ there: the input's and the outputs' own letters)."""
    rank = len(call.inputs[0].shape)
    dim %= rank
    ids = letters(rank)

    def text(name: str) -> str:
        return " ".join(name if k == dim else x for k, x in enumerate(ids))

    ins = [text(f"{ids[dim]}{k}^") for k in range(tensors)]
    return ", ".join(ins) + " -> " + ", ".join([text("o^")] * outputs)


@rule("aten.topk.default", "moe")
def topk(call: OpCall) -> str:
    """The router's top-k: each row (token) on its own; the dim it selects from stays whole."""
    return _along(call, call.arg(2, "dim", -1), 1, 2)


@rule("aten.gather.default", "moe")
def gather(call: OpCall) -> str:
    """`x.gather(dim, index)` with index as large as x outside `dim` (the router's chosen scores):
    rows on their own; else every dim whole."""
    x, index = call.inputs[0].shape, call.inputs[1].shape
    dim = call.arg(1, "dim") % len(x)
    if len(x) == len(index) and all(a == b for k, (a, b) in enumerate(zip(x, index)) if k != dim):
        return _along(call, dim, 2, 1)
    ins = [" ".join(f"{c}^" for c in letters(len(m.shape), 10 * k)) for k, m in enumerate(call.inputs)]
    return ", ".join(ins) + " -> " + " ".join(f"{c}^" for c in letters(len(call.outputs[0].shape), 30))
