"""Attention: split by batch or by heads; self-attention may also be split by sequence (context parallel).

Grouped-query attention through SDPA's `enable_gqa` (query head `i` reads key/value head
`i // (query heads / kv heads)`) splits by kv-head group: query heads as `(g r)`, whose first sub-dim
`g` is a contiguous split, and key/value heads as `g`, so each rank keeps whole groups. Multi-query
attention (one key/value head, broadcast to every query head) splits the query heads and reads the
key and value whole on every rank.

Self-attention (queries and keys of one sequence: the same length, traced or symbolic) names the key
sequence like the query's, `s`. It stays `^`: a plain split would be wrong (softmax over the whole
sequence, causal masks), so policies that enumerate splits never pick it. A split on `s` is allowed
only through its special, `context_parallel_attention` (nnscaler.runtime.context_parallel): each
device holds a contiguous chunk of the sequence of q, k and v, and the kernel passes key/value blocks
around a ring (or all-to-alls to heads) so that every query row sees the whole sequence. A mask keeps
its key columns whole (`t^`): each device reads the rows of its queries.
"""

from __future__ import annotations

from nnscaler.graph.ops.registry import OpCall, Special, rule

CONTEXT_PARALLEL_ATTENTION = "context_parallel_attention"


def _same_sequence(call: OpCall) -> bool:
    q, k = call.inputs[0], call.inputs[1]
    if q.shape[-2] != k.shape[-2]:
        return False
    qsym = q.sym[-2] if q.sym else None
    ksym = k.sym[-2] if k.sym else None
    return qsym == ksym


@rule(
    "aten.scaled_dot_product_attention.default",
    "attention",
    specials={"s": Special(CONTEXT_PARALLEL_ATTENTION, splits_fixed=True)},
)
def sdpa(call: OpCall) -> str:
    q, k = call.inputs[0].shape, call.inputs[1].shape
    shared = k[-3] == 1 and q[-3] > 1  # one key/value head for every query head (multi-query)
    grouped = bool(call.arg(7, "enable_gqa", False)) and q[-3] != k[-3] and not shared
    heads = "h" if q[-3] == k[-3] or shared else f"(g {q[-3] // k[-3]})" if grouped else "h^"
    kv_heads = "h" if q[-3] == k[-3] else "1" if shared else "g" if grouped else "g^"
    lead = "* " if len(q) > 3 else ""
    kv_seq = "s" if _same_sequence(call) else "t"
    ins = [f"{lead}{heads} s^ d^", f"{lead}{kv_heads} {kv_seq}^ d^", f"{lead}{kv_heads} {kv_seq}^ e^"]
    if len(call.inputs) > 3:  # attn_mask broadcasts against (*, h, s, t)
        mask = call.inputs[3].shape
        full = ["_m"] * (len(q) - 3) + [heads.rstrip("^"), "s", "t"]
        offset = len(full) - len(mask)
        ids = []
        for i, size in enumerate(mask):
            name = full[i + offset]
            target = (list(q[:-3]) + [q[-3], q[-2], k[-2]])[i + offset]
            if size == 1 and target != 1:
                ids.append("1")
            elif name == "_m":
                ids.append(f"_s{i + offset}")
            else:
                ids.append(name + ("^" if name in ("s", "t") or heads.endswith("^") else ""))
        ins.append(" ".join(ids))
    return ", ".join(ins) + f" -> {lead}{heads} s^ e^"
