"""The `nnscaler-train` command (also `python -m nnscaler.cli.train`).

nnscaler-train -f cfg.yaml [--a.b.c value ...] [--key!]     train (or compile: --run_mode compile)
torchrun --nproc_per_node 4 -m nnscaler.cli.train -f cfg.yaml
nnscaler-train merge CHECKPOINT_DIR OUTPUT_FILE               one merged file (.safetensors: weights)
nnscaler-train plot EVENT_DIR OUTPUT.png                      loss curve from TensorBoard event files
nnscaler-train --plot EVENT_DIR [OUTPUT.png]                  the same
"""

from __future__ import annotations

import os
import sys

from nnscaler.errors import NnScalerError

__all__ = ["main", "add_working_dir"]


def add_working_dir() -> None:
    """Put the working directory first on sys.path, as `python -m` does, so that a config's
    `model.type: my_model.Net` finds ./my_model.py (the `nnscaler-train` script starts without it)."""
    cwd = os.getcwd()
    if not any(os.path.abspath(p or os.curdir) == cwd for p in sys.path):
        sys.path.insert(0, cwd)


def main(argv: list[str] | None = None) -> int:
    """Run the command; returns the exit status (2 for a config or checkpoint error, printed plainly)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    add_working_dir()
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    try:
        if argv[0] == "merge":
            if len(argv) != 3:
                print("usage: nnscaler-train merge CHECKPOINT_DIR OUTPUT_FILE", file=sys.stderr)
                return 2
            from nnscaler.cli.trainer import Trainer

            Trainer.merge_checkpoint(argv[1], argv[2])
            print(f"nnscaler-train: wrote {argv[2]}")
            return 0
        if argv[0] in ("plot", "--plot"):
            if len(argv) not in (2, 3):
                print("usage: nnscaler-train plot EVENT_DIR [OUTPUT.png]", file=sys.stderr)
                return 2
            from nnscaler.cli.plot import plot_loss

            out = plot_loss(argv[1], argv[2] if len(argv) == 3 else "loss.png")
            print(f"nnscaler-train: wrote {out}")
            return 0
        from nnscaler.cli.trainer import Trainer

        Trainer(argv).run()
        return 0
    except NnScalerError as err:
        print(f"nnscaler-train: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
