"""The config reference of docs/trainer.md, generated from the dataclasses' field docstrings.

    python -m nnscaler.cli.docgen docs/trainer.md     # rewrite the generated section in place

The section lies between `<!-- fields:begin -->` and `<!-- fields:end -->`; a test checks that the
file matches, so the reference cannot drift from the code.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import sys
import typing
from pathlib import Path

from nnscaler.cli import configs
from nnscaler.cli.trainer_args import TrainerArgs
from nnscaler.config import ComputeConfig

__all__ = ["field_docs", "render_reference", "update_file", "BEGIN", "END"]

BEGIN, END = "<!-- fields:begin -->", "<!-- fields:end -->"

SECTIONS = [
    ("TrainerArgs", TrainerArgs),
    ("compute_config: ComputeConfig", ComputeConfig),
    ("model: ModelConfig", configs.ModelConfig),
    ("model.parallel_modules[]: ModuleParallelizeConfig", configs.ModuleParallelizeConfig),
    ("optimizer: OptimizerConfig", configs.OptimizerConfig),
    ("dataset: DatasetConfig", configs.DatasetConfig),
    ("dataloader: DataloaderConfig", configs.DataloaderConfig),
    ("dataset_sampler: DatasetSamplerConfig", configs.DatasetSamplerConfig),
    ("lr_scheduler: LRSchedulerConfig", configs.LRSchedulerConfig),
    ("checkpoint: CheckpointConfig", configs.CheckpointConfig),
    ("checkpoint.resume_from: ResumeOptions", configs.ResumeOptions),
    ("log[]: LogConfig", configs.LogConfig),
    ("hook: HookConfig", configs.HookConfig),
    ("debug: DebugConfig", configs.DebugConfig),
    ("model.parallel_modules[].compute_config: OptionalComputeConfig", configs.OptionalComputeConfig),
]


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal written right below it in the class body."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return f"`{value!r}`" if not dataclasses.is_dataclass(value) else "(defaults)"
    return "required"


def _type(cls: type, name: str) -> str:
    hint = typing.get_type_hints(cls).get(name)
    text = getattr(hint, "__name__", None) if isinstance(hint, type) else None
    text = text or str(hint).replace("typing.", "").replace("nnscaler.cli.configs.", "")
    return text.replace("nnscaler.config.", "").replace("NoneType", "None").replace("|", "\\|")


def render_reference() -> str:
    """Markdown: one table per config dataclass (field, type, default, meaning)."""
    out = []
    for title, cls in SECTIONS:
        out.append(f"### `{title}`\n")
        out.append(" ".join((cls.__doc__ or "").split()) + "\n")
        docs = field_docs(cls)
        out.append("| field | type | default | meaning |\n| --- | --- | --- | --- |")
        for f in dataclasses.fields(cls):
            out.append(f"| `{f.name}` | {_type(cls, f.name)} | {_default(f)} | {docs.get(f.name, '')} |")
        out.append("")
    out.append(
        "`hook` may also be a `HookMapConfig`: a mapping from hook name (`"
        + "`, `".join(f.name for f in dataclasses.fields(configs.HookMapConfig))
        + "`) to the dotted name of a function called as `fn(trainer, ...)`.\n"
    )
    return "\n".join(out)


def update_file(path: str | Path) -> bool:
    """Rewrite the generated section of `path`; True if it changed."""
    path = Path(path)
    text = path.read_text()
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{BEGIN}\n{render_reference()}\n{END}{tail}"
    if new != text:
        path.write_text(new)
    return new != text


if __name__ == "__main__":
    changed = update_file(sys.argv[1] if len(sys.argv) > 1 else "docs/trainer.md")
    print("updated" if changed else "up to date")
