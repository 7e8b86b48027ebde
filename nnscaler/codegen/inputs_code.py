"""The first lines of a forward: nested or non-tensor arguments taken apart as traced, arguments left
at their defaults checked, input sizes bound and checked (nnscaler.codegen.shape_code)."""

from __future__ import annotations

from nnscaler.codegen.shape_code import rule_check_lines, size_check_lines
from nnscaler.partition import Program

__all__ = ["unpack_inputs"]


def unpack_inputs(
    program: Program, rules: list | None = None, folded: frozenset[str] = frozenset()
) -> tuple[list[str], str | None]:
    """Plain tensor arguments are used by name; nested or non-tensor ones are flattened as traced;
    arguments left at their defaults when traced are checked; then input sizes are bound and checked
    against the traced shapes and the `rules` (default: the program's shape rules). `folded`: the size
    names the code was written with as constants (constant_folding=True), fixed to their traced sizes."""
    lines, in_spec = _unpack_leaves(program)
    lines += size_check_lines(program.input_meta, program.size_names, program.static_shapes, folded)
    rules = program.shape_rules if rules is None else rules
    lines += rule_check_lines(rules, program.size_names, program.input_meta)
    return lines, in_spec


def _unpack_leaves(program: Program) -> tuple[list[str], str | None]:
    check = []
    if program.untraced_args:
        given = ", ".join(f'"{k}": {k}' for k in program.untraced_args)
        check = [f"self.check_untraced_args({{{given}}}, {program.untraced_args!r})"]
    if program.input_leaves == program.forward_args:
        return check, None
    kwargs = ", ".join(f'"{a}": {a}' for a in program.forward_args)
    lines = check + [
        f"leaves, spec = pytree.tree_flatten(((), {{{kwargs}}}))",
        "self.check_input_structure(spec, _IN_SPEC)",
    ]
    lines += [f"{name} = leaves[{i}]" for i, name in enumerate(program.input_leaves) if name is not None]
    lines += [
        f"self.check_constant_input({i}, leaves[{i}], {value!r})  # traced as a constant"
        for i, value in ((int(k), v) for k, v in program.input_constants.items())
    ]
    return lines, program.in_spec
