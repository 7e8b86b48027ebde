"""nnScaler's output layout: gen_savedir/_parallel_modules/<module path>/<Class>/<instance>/."""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = ["module_outdir"]


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
