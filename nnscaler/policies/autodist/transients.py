"""Working sets that live for part of a step, beside what is kept for backward: a mixture-of-experts
op's backward (it reruns its forward under autograd, nnscaler/runtime/moe/op.py) and ZeRO-3's gathered
parameter blocks and full gradient buffers (nnscaler/runtime/grads/zero3.py)."""

from __future__ import annotations

from nnscaler.graph.ir import Graph
from nnscaler.graph.ops.moe import MOE_EXPERTS_OP
from nnscaler.policies.autodist.cost import CostContext
from nnscaler.policies.autodist.memo import graph_memo

__all__ = ["moe_rerun_bytes", "zero3_block_bytes", "ZERO3_BLOCKS_LIVE"]

ZERO3_BLOCKS_LIVE = 1.0
"""Full-size blocks ZeRO-3 holds beyond the model's other buffers: the gathered block computing. The
prefetched block and the gradient buffers waiting for their reduce-scatter (zero3.py) were not seen
on top of the transient buffers on the zoo (benchmarks/memory_model_vs_measured.py: with 4 blocks
ZeRO-3 rows read 1.16-1.22, with 1 within 1.05 of the measured peak)."""


def moe_rerun_bytes(graph: Graph, ctx: CostContext) -> float:
    """Bytes per device of the largest experts op's backward: its forward again under autograd, which
    saves per routed row (tokens x top-k) the gathered hidden state and the down projection's output
    (h each), the gate/up output (2i), the activation and the gated product (i each): rows (2h + 4i).
    Over tensor-parallel devices the experts' intermediate size is what splits (the tp layout of expert
    MLPs: gate/up by columns, down by rows), so the h-wide rows stay whole on every device: rows
    (2h + 4i / ways) (measured on the zoo's Mixtral at tp 2: the gathered (rows, h) input and the
    down projection's (rows, h) partial sums at full width beside (rows, i/2) intermediates)."""
    if not ctx.training:
        return 0.0
    best = 0.0
    for node in graph.nodes:
        if node.op != MOE_EXPERTS_OP:
            continue
        refs = [r for r in node.input_names() if graph.values[r].meta is not None]
        if len(refs) < 5 or len(graph.values[refs[4]].meta.shape) != 3:
            continue
        hidden, index, down = (graph.values[refs[i]].meta for i in (0, 1, 4))
        h, i = down.shape[1], down.shape[2]
        rows = index.numel * ctx.value_scale(graph, refs[0])
        best = max(best, rows * (2 * h + 4 * i / max(ctx.ways, 1)) * ctx.elem_bytes(hidden.dtype))
    return best


def zero3_block_bytes(graph: Graph, ctx: CostContext) -> float:
    """Whole bytes of the largest ZeRO-3 block's parameters on one device (a block: the module path up
    to its first layer index, else its first two names, as runtime/grads/zero3_blocks.block_of)."""
    memo = graph_memo(graph).setdefault("zero3_blocks", {})
    key = (ctx.compute_dtype, ctx.ways)
    if key not in memo:
        first: dict[str, str] = {}
        for node in graph.nodes:
            for ref in node.input_names():
                if graph.values[ref].kind == "param" and ref not in first:
                    first[ref] = node.module_path
        blocks: dict[str, float] = {}
        for ref, path in first.items():
            block = _block_of(path)
            blocks[block] = blocks.get(block, 0.0) + ctx.value_bytes(graph, ref)
        memo[key] = max(blocks.values(), default=0.0) / max(ctx.ways, 1)
    return memo[key]


def _block_of(module_path: str) -> str:
    parts = module_path.split(".") if module_path else []
    for k, p in enumerate(parts):
        if p.isdigit():
            return ".".join(parts[: k + 1])
    return ".".join(parts[:2])
