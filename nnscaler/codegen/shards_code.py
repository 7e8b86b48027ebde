"""`__init__`'s registrations: one `add_shard` per parameter and buffer this rank holds (repeated layers
as loops, nnscaler.codegen.shard_loops) and one `add_alias` per tied name."""

from __future__ import annotations

from nnscaler.codegen.lines import ShardLine
from nnscaler.codegen.safe_text import literal
from nnscaler.codegen.shard_loops import ShardCall, shard_loop_lines
from nnscaler.graph.ir import MeshLayout, Replicate, Shard, storage_shard
from nnscaler.partition import LocalTensor, Program

__all__ = ["shard_lines", "frozen_params"]


def _shard_arg(layout, tp_index: int, ways: int, mesh: tuple[int, ...] = ()) -> str:
    shard = storage_shard(layout, tp_index, mesh or (ways,))
    return f", shard={shard}" if shard is not None else ""


def _shard_comment(layout, ways: int) -> str:
    if isinstance(layout, MeshLayout):
        return f"mesh layout {layout}"
    if isinstance(layout, Shard) and ways > 1:
        what = "rows" if layout.dim == 0 else f"dim {layout.dim}"
        blocks = f" of each of {layout.blocks} blocks" if layout.blocks > 1 else ""
        return f"{what}: 1/{ways}{blocks}"
    return "replicated" if isinstance(layout, Replicate) else str(layout)


def frozen_params(programs: list[Program]) -> set[str]:
    """Parameters the user froze (`requires_grad=False` when traced): registered without gradients."""
    return {
        t.name
        for p in programs
        for t in p.tensors
        if t.is_param and t.name in p.local_meta and not p.local_meta[t.name].requires_grad
    }


def shard_lines(
    tensors: list[LocalTensor],
    tp_index: int,
    ways: int,
    mesh: tuple[int, ...] = (),
    frozen: set[str] | frozenset[str] = frozenset(),
) -> tuple[list[ShardLine], list[str]]:
    """`add_shard` lines for this rank's parameters and buffers, and `add_alias` lines for tied names.
    Parameters named in `frozen` are registered with `requires_grad=False`."""
    calls = []
    for t in tensors:
        kind = "" if t.is_param else ", is_param=False" + ("" if t.persistent else ", persistent=False")
        if t.is_param and t.name in frozen:
            kind += ", requires_grad=False"
        rest = f", {tuple(t.full_shape)}, torch.{t.dtype}{_shard_arg(t.layout, tp_index, ways, mesh)}{kind})"
        comment = _shard_comment(t.layout, ways) + ("; frozen" if t.is_param and t.name in frozen else "")
        calls.append(ShardCall(t.name, t.original_name, rest, comment))
    aliases = [
        f"self.add_alias({literal(a)}, {literal(t.original_name)})" for t in tensors for a in t.aliases
    ]
    return shard_loop_lines(calls), aliases
