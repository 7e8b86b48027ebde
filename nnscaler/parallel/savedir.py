"""nnScaler's output layout: gen_savedir/_parallel_modules/<module path>/<Class>/<instance>/.

What the directory holds, by kind (what `BroadcastGenFilesStrategy` sends):

- code: `gencode{rank}.py` for every rank, plus what importing and constructing one needs:
  `compute_config.json` and `constants.pt` (tensors the forward makes from literals);
- weights: `fullmodel.pt`, the module's initial weights (written when `parallelize` is given a
  class, so that `GenModel(init_params=True)` starts from the same values on every rank);
- the rest: `graph.json`, `plan.json`, `fingerprint.json` (for reuse and for reading).
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = [
    "module_outdir",
    "WEIGHTS_FILE",
    "FINGERPRINT_FILE",
    "GRAPH_FILE",
    "is_code_file",
    "is_weight_file",
    "generated_files",
]

WEIGHTS_FILE = "fullmodel.pt"
FINGERPRINT_FILE = "fingerprint.json"
GRAPH_FILE = "graph.json"
_CODE_SUPPORT = frozenset({"compute_config.json", "constants.pt"})


def module_outdir(
    gen_savedir: str | Path, module_class: type[torch.nn.Module], instance_name: str | None
) -> Path:
    module_path = module_class.__module__.replace(".", "/")
    return (
        Path(gen_savedir)
        / "_parallel_modules"
        / module_path
        / module_class.__qualname__
        / (instance_name or "_")
    )


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
