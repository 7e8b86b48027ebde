"""Weights replicated along plan axes where their readers are split on data dims (batch, sequence,
tokens): each rank's gradient is a partial sum over the axis. Instead of a `copy_to_group` per weight
(an all-reduce of its own inside backward), the program names the axes (`Program.grad_groups`) and the
runtime's gradient reducer sums these gradients over them together with the data-parallel replicas,
in its buckets, overlapped with backward.
"""

from __future__ import annotations

import dataclasses

from nnscaler.graph.ir import Layout, Ref, map_refs
from nnscaler.partition.program import Program

__all__ = ["fold_weight_syncs"]


def fold_weight_syncs(
    program: Program, reads: dict[str, set[tuple | None]], layouts: dict[str, Layout]
) -> None:
    """Drop the `copy_to_group` of each weight whose every read is of the stored tensor with the same,
    non-empty sync groups (`reads`: weight -> the sync groups of each read, None for a read of a converted
    copy); record those groups in `program.grad_groups`.

    Kept where readers differ (one split on the axis, one not: only the split readers' gradients are
    partial sums, so a sum over every rank of the axis would count the others' several times), and where
    a read converts the weight first (the conversion's backward already moves its gradient)."""
    folded = {}
    for name, seen in reads.items():
        only = next(iter(seen))
        if len(seen) == 1 and only:
            folded[name] = only
    if not folded:
        return
    rename: dict[str, str] = {}
    kept = []
    for s in program.statements:
        if s.kind == "comm" and s.op == "copy_to_group":
            src = rename.get(s.args[0].name, s.args[0].name)
            if src in folded:
                rename[s.outputs[0]] = src
                layouts.pop(s.outputs[0], None)
                program.local_meta.pop(s.outputs[0], None)
                continue
        if rename:
            swap = lambda r: Ref(rename.get(r.name, r.name))  # noqa: E731
            s = dataclasses.replace(s, args=map_refs(s.args, swap), kwargs=map_refs(s.kwargs, swap))
        kept.append(s)
    program.statements = kept
    program.outputs = map_refs(program.outputs, lambda r: Ref(rename.get(r.name, r.name)))
    program.grad_groups = folded
