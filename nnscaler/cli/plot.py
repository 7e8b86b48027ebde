"""Loss curves from TensorBoard event files: `read_scalars(log_dir)` and a PNG via matplotlib.

nnscaler-train plot ./tensorboard/run loss.png [--tag train/loss]
"""

from __future__ import annotations

from pathlib import Path

from nnscaler.errors import ConfigError

__all__ = ["read_scalars", "plot_loss"]


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar under `log_dir`: name -> [(step, value), ...] by step. A scalar written in a
    sub-directory (TensorBoardLogger's per-tag runs) is named `<sub-directory>/<scalar>`."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError as err:
        raise ConfigError(
            "reading event files needs the tensorboard package (pip install tensorboard)"
        ) from err
    if not Path(log_dir).is_dir():
        raise ConfigError(f"no event files: {log_dir} is not a directory")
    root = Path(log_dir)
    out: dict[str, list[tuple[int, float]]] = {}
    for run in sorted({f.parent for f in root.rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(run), size_guidance={"scalars": 0})
        acc.Reload()
        prefix = run.relative_to(root).as_posix()
        for tag in acc.Tags()["scalars"]:
            name = tag if prefix == "." else f"{prefix}/{tag}"
            out.setdefault(name, []).extend((e.step, e.value) for e in acc.Scalars(tag))
    return {name: sorted(points) for name, points in out.items()}


def plot_loss(
    log_dir: str | Path, output: str | Path, tags: tuple[str, ...] = ("train/loss", "val/loss")
) -> Path:
    """Write a PNG of `tags` against the step; ConfigError (clear message) if matplotlib is missing."""
    scalars = read_scalars(log_dir)
    present = [t for t in tags if t in scalars]
    if not present:
        raise ConfigError(f"{log_dir}: none of the tags {list(tags)} was logged (found {sorted(scalars)})")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ConfigError(
            "plotting needs matplotlib, which is not installed (pip install matplotlib); "
            "the numbers are readable with nnscaler.cli.plot.read_scalars"
        ) from err
    fig, ax = plt.subplots(figsize=(7, 4))
    for tag in present:
        steps, values = zip(*scalars[tag])
        ax.plot(steps, values, label=tag, marker="." if len(steps) < 50 else None)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    output = Path(output)
    fig.savefig(output, dpi=100)
    plt.close(fig)
    return output
