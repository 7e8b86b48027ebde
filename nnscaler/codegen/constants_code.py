"""Class attributes naming the constants a generated module loads: tensors the forward makes from
literals (`torch.tensor([...])`) or reads from plain tensor attributes, lifted by torch.export.

Their values are saved once, in `constants.pt` beside the generated files, for every rank. Each rank
registers (as non-persistent buffers) only the constants its own code uses; `constant_users` names,
for every constant some rank uses, who uses it, so that every rank can check the file holds them all
and fail alike, naming the key and its users, when it does not (nnscaler.runtime.module_parts.constants).
"""

from __future__ import annotations

from collections.abc import Callable

from nnscaler.codegen.safe_text import literal
from nnscaler.partition import LocalTensor, PipelineProgram, Program

__all__ = [
    "CONSTANTS_FILE_NAME",
    "constant_key",
    "spmd_constant_users",
    "pipeline_constant_users",
    "constants_attrs",
]

CONSTANTS_FILE_NAME = "constants.pt"
"""Where the compiler saves the constants' values (nnscaler.parallel.savedir.CONSTANTS_FILE)."""


def constant_key(t: LocalTensor, constant_names: set[str]) -> str | None:
    """The key of `t`'s value in the constants file, or None when `t` is no constant."""
    return next((n for n in (t.original_name, *t.aliases) if n in constant_names), None)


def spmd_constant_users(program: Program) -> dict[str, str]:
    """Constant key -> who uses it, for a plan without pipeline stages (every rank runs the same code)."""
    names = set(program.constant_names)
    keys = [constant_key(t, names) for t in program.tensors]
    return {k: "every rank" for k in sorted(k for k in keys if k is not None)}


def pipeline_constant_users(pprog: PipelineProgram, ranks_of: Callable[[int], list[int]]) -> dict[str, str]:
    """Constant key -> the stages using it and the ranks running them (`ranks_of(stage)`: those of this
    rank's data-parallel replica)."""
    names = set(pprog.inputs.constant_names)
    stages: dict[str, list[int]] = {}
    for stage in pprog.stages:
        for t in stage.program.tensors:
            key = constant_key(t, names)
            if key is not None and stage.index not in stages.setdefault(key, []):
                stages[key].append(stage.index)
    out = {}
    for key in sorted(stages):
        used = sorted(stages[key])
        ranks = sorted({r for s in used for r in ranks_of(s)})
        what = f"stage{'s' if len(used) > 1 else ''} {', '.join(map(str, used))}"
        out[key] = f"{what} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})"
    return out


def constants_attrs(users: dict[str, str]) -> list[str]:
    """`constants_file` and `constant_users` class attribute lines (none when no rank uses a constant).

    Every rank of one compile gets the same two attributes, whether or not its own code uses a constant."""
    if not users:
        return []
    entries = "".join(f"\n        {literal(k)}: {literal(v)}," for k, v in users.items())
    return [
        f'constants_file = "{CONSTANTS_FILE_NAME}"  # values of the tensors the forward makes from literals',
        f"constant_users = {{  # who uses each: every rank checks the file holds all, loads its own{entries}\n    }}",
    ]
