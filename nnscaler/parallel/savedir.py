"""nnScaler's output layout: gen_savedir/_parallel_modules/<module path>/<Class>/<instance>/.

What the directory holds, by kind (what `BroadcastGenFilesStrategy` sends):

- code: `gencode{rank}.py` for every rank, plus what importing and constructing one needs:
  `compute_config.json`, `constants.pt` (tensors the forward makes from literals) and
  `fingerprint.json` (written last; it records the sha256 of every generated file, checked before
  a rank imports its code: see `nnscaler.parallel.artifacts`);
- weights: `fullmodel.pt`, the module's initial weights (written when `parallelize` is given a
  class, so that `GenModel(init_params=True)` starts from the same values on every rank);
- the rest: `graph.json`, `plan.json` (for `reuse='graph'` and for reading).

Paths stay inside gen_savedir: `instance_name` is one or more plain names joined by "/" (no "..",
no absolute path), and the parts that come from the class (`__module__`, `__qualname__`) have
separators and dot-only names replaced. `.<instance>.lock` beside the directory (hidden) serialises
compiles into it.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from nnscaler.errors import ConfigError

__all__ = [
    "module_outdir",
    "WEIGHTS_FILE",
    "FINGERPRINT_FILE",
    "GRAPH_FILE",
    "PLAN_FILE",
    "COMPUTE_CONFIG_FILE",
    "CONSTANTS_FILE",
    "lock_file",
    "is_code_file",
    "is_weight_file",
    "generated_files",
]

WEIGHTS_FILE = "fullmodel.pt"
FINGERPRINT_FILE = "fingerprint.json"
GRAPH_FILE = "graph.json"
PLAN_FILE = "plan.json"
COMPUTE_CONFIG_FILE = "compute_config.json"
CONSTANTS_FILE = "constants.pt"
_CODE_SUPPORT = frozenset({COMPUTE_CONFIG_FILE, CONSTANTS_FILE, FINGERPRINT_FILE})


def module_outdir(
    gen_savedir: str | Path, module_class: type[torch.nn.Module], instance_name: str | None
) -> Path:
    """gen_savedir/_parallel_modules/<module path>/<Class>/<instance_name or "_">, checked to stay
    inside gen_savedir (ConfigError naming `instance_name` otherwise)."""
    base = Path(gen_savedir) / "_parallel_modules"
    module_parts = [_plain_part(p) for p in str(module_class.__module__).split(".")]
    outdir = base.joinpath(*module_parts, _plain_part(module_class.__qualname__))
    outdir = outdir.joinpath(*_instance_parts(instance_name))
    root, resolved = Path(gen_savedir).resolve(), outdir.resolve()
    if not resolved.is_relative_to(root):  # a link on the way points elsewhere
        raise ConfigError(
            f"the output directory {outdir} resolves to {resolved}, outside gen_savedir={str(gen_savedir)!r} "
            "(a symbolic link on the way?); pass another instance_name or gen_savedir"
        )
    return outdir


def _plain_part(part: str) -> str:
    """A name from the class as one path part: separators and NUL become '_', '', '.', '..' become '_'."""
    for bad in ("/", "\\", "\0", os.sep):
        part = part.replace(bad, "_")
    return "_" if part in ("", ".", "..") else part


def _instance_parts(instance_name: str | None) -> list[str]:
    """The path parts of `instance_name` ("_" when None); ConfigError unless plain names under gen_savedir."""
    if instance_name is None:
        return ["_"]
    if not isinstance(instance_name, str):
        raise ConfigError(f"instance_name must be a str, got {type(instance_name).__name__}")
    parts = instance_name.split("/")
    bad = (
        not instance_name
        or instance_name.startswith("/")
        or Path(instance_name).is_absolute()
        or "\\" in instance_name
        or "\0" in instance_name
        or any(p in ("", ".", "..") for p in parts)
    )
    if bad:
        raise ConfigError(
            f"instance_name={instance_name!r} must be a plain name (or names joined by '/') that stays "
            "inside gen_savedir: no '..', '.', empty parts, backslashes or absolute paths. Use e.g. "
            "instance_name='run1' or 'exp/run1'; to write elsewhere, pass another gen_savedir"
        )
    return parts


def lock_file(outdir: Path) -> Path:
    """The lock serialising compiles into `outdir`: hidden, beside it (`.<name>.lock`)."""
    return outdir.parent / f".{outdir.name}.lock"


def is_weight_file(name: str) -> bool:
    """Model weights (`fullmodel.pt`, or pieces `fullmodel.pt.0`, ... as nnScaler names them)."""
    return name == WEIGHTS_FILE or name.startswith(WEIGHTS_FILE + ".")


def is_code_file(name: str) -> bool:
    """What a rank needs to import and construct its module (without weights)."""
    return (name.startswith("gencode") and name.endswith(".py")) or name in _CODE_SUPPORT


def generated_files(outdir: Path) -> list[Path]:
    """The files of an output directory, sorted (temporary and hidden files excluded)."""
    if not outdir.is_dir():
        return []
    return sorted(p for p in outdir.iterdir() if p.is_file() and not p.name.startswith("."))
