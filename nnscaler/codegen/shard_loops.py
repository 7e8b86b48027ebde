"""`add_shard` lines of `__init__`, with the lines of repeated layers written once, as a loop:

    for i in range(32):  # model.layers.0 .. model.layers.31: 9 tensors each, stored alike
        self.add_shard(f"model_layers_{i}_self_attn_q_proj_weight", f"model.layers.{i}.self_attn.q_proj.weight", (64, 64), torch.float32, shard=(0, 0, 8, 1))  # rows: 1/8
        ...

Layers are looped over where their lines differ only by the layer index (same tensors, shapes,
dtypes, shards and comments, the layers one after another); the loop registers the same tensors in
the same order as the lines it replaces."""

from __future__ import annotations

import re
from dataclasses import dataclass

from nnscaler.codegen.lines import ShardLine
from nnscaler.codegen.safe_text import literal

__all__ = ["ShardCall", "shard_loop_lines"]

_PLAIN = re.compile(r"[\w.]*")


@dataclass(frozen=True)
class ShardCall:
    """One `self.add_shard(name, original, <rest>  # comment` line."""

    name: str
    original: str
    rest: str
    """Everything after the two names: `, (64, 64), torch.float32, shard=(0, 0, 2, 1))`."""
    comment: str

    def line(self) -> ShardLine:
        return ShardLine(
            f"self.add_shard({literal(self.name)}, {literal(self.original)}{self.rest}", self.comment
        )


def _layer_of(call: ShardCall) -> tuple[str, int, tuple] | None:
    """(layer base path, layer index, the line's form without the index) when the tensor is inside a
    numbered layer (`model.layers.3.mlp.weight`) and its local name follows the path."""
    parts = call.original.split(".")
    at = next((i for i, p in enumerate(parts) if p.isdigit()), None)
    if at is None or at == 0 or at == len(parts) - 1 or not parts[at].isascii():
        return None
    if str(int(parts[at])) != parts[at]:  # leading zeros
        return None
    base, tail = ".".join(parts[:at]), ".".join(parts[at + 1 :])
    name_pre, name_post = re.sub(r"\W", "_", base) + "_", "_" + re.sub(r"\W", "_", tail)
    index = int(parts[at])
    if call.name != f"{name_pre}{index}{name_post}" or not all(_PLAIN.fullmatch(x) for x in (base, tail)):
        return None
    return base, index, ((name_pre, name_post), tail, call.rest, call.comment)


def _runs(calls: list[ShardCall]) -> list[tuple[str | None, int, list[ShardCall], tuple]]:
    """Consecutive calls grouped by layer: (base, index, calls, form of the layer's lines)."""
    runs: list[tuple[str | None, int, list[ShardCall], tuple]] = []
    for call in calls:
        layer = _layer_of(call)
        if layer is None:
            runs.append((None, 0, [call], ()))
            continue
        base, index, form = layer
        if runs and runs[-1][0] == base and runs[-1][1] == index:
            prev = runs[-1]
            runs[-1] = (base, index, [*prev[2], call], (*prev[3], form))
        else:
            runs.append((base, index, [call], (form,)))
    return runs


def _loop(base: str, first: int, last: int, form: tuple) -> list[ShardLine]:
    span = f"range({last + 1})" if first == 0 else f"range({first}, {last + 1})"
    header = ShardLine(
        f"for i in {span}:", f"{base}.{first} .. {base}.{last}: {len(form)} tensors each, stored alike"
    )
    lines = [header]
    for (name_pre, name_post), tail, rest, comment in form:
        code = f'self.add_shard(f"{name_pre}{{i}}{name_post}", f"{base}.{{i}}.{tail}"{rest}'
        lines.append(ShardLine(code, comment, 1))
    return lines


def shard_loop_lines(calls: list[ShardCall]) -> list[ShardLine]:
    """The lines registering `calls`, in order, consecutive layers alike as one loop."""
    runs = _runs(calls)
    out: list[ShardLine] = []
    i = 0
    while i < len(runs):
        base, index, group, form = runs[i]
        j = i + 1
        while base is not None and j < len(runs) and runs[j][0] == base and runs[j][1] == index + (j - i):
            if runs[j][3] != form:
                break
            j += 1
        if j - i >= 2:
            out += _loop(base, index, index + j - i - 1, form)
        else:
            out += [c.line() for c in group]
        i = j
    return out
