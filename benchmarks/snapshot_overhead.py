"""Step time with and without in-memory snapshots (nnscaler.cli.elastic), and the bytes they keep.

    python benchmarks/snapshot_overhead.py [--steps 30] [--rounds 2] [--plan 2 --runtime 4] [--every auto|N]

Trains the nanoGPT example's Trainer config (examples/nanogpt/train_cli.yaml: its default model, tp 2 x
dp 2 on 4 gloo processes as 2 simulated nodes, offline corpus) alternately without snapshots and with
`snapshot_every` (`auto`: the default under torchrun --max-restarts),
`--rounds` times each, so that drift in machine load hits both alike. The step time is the Trainer's
`train/step_time` (the boundary's copy included; the background write shows up in the next step), the
median over the steps after `--warmup`. Bytes: one rank's serialized snapshot; the most a rank can
keep (own and peer copies of the newest complete step and of the one being written); and the most
the node's snapshot directory was seen holding per rank at step boundaries. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from nnscaler.cli import Trainer  # noqa: E402
from tests.dist_util import spawn  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "nanogpt" / "train_cli.yaml"


class TimedTrainer(Trainer):
    """Keeps every step's time and the most bytes the node's snapshot directory held."""

    def __init__(self, argv: list[str]):
        super().__init__(argv)
        self.step_times: list[float] = []
        self.peak_dir_bytes = 0

    def log_metrics(
        self, metrics: dict[str, float], step: int | None = None, *, tag: str | None = None
    ) -> None:
        super().log_metrics(metrics, step, tag=tag)
        if "train/step_time" in metrics:
            self.step_times.append(metrics["train/step_time"])
            writer = self.elastic.writer
            if writer is not None and writer.root.is_dir():
                size = sum(p.stat().st_size for p in writer.root.rglob("*.ckpt") if p.is_file())
                self.peak_dir_bytes = max(self.peak_dir_bytes, size)


def _run(rank: int, world: int, argv: list[str], env: dict[str, str]) -> dict[str, Any]:
    os.environ.update(env)  # after the spawn helper's own LOCAL_WORLD_SIZE: simulated nodes
    trainer = TimedTrainer(argv)
    trainer.run()
    writer = trainer.elastic.writer
    return {
        "step_times": trainer.step_times,
        "snapshot_bytes": writer.bytes_own if writer is not None else 0,
        "kept_bytes_bound_per_rank": writer.kept_bytes(writer.bytes_own) // writer.member.local_world_size
        if writer is not None
        else 0,
        "peak_dir_bytes": trainer.peak_dir_bytes,
        "ranks_per_node": writer.member.local_world_size if writer is not None else world,
        "every_at_end": writer.every if writer is not None else 0,
    }


def _argv(args: argparse.Namespace, tmp: Path, every: str) -> list[str]:
    snapshots = [] if every == "auto" else ["--snapshot_every", every]
    return [
        "-f",
        str(CONFIG),
        "--vars.offline",
        "True",
        "--compute_config.plan_ngpus",
        str(args.plan),
        "--compute_config.runtime_ngpus",
        str(args.runtime),
        "--max_train_steps",
        str(args.steps),
        "--val_every_n_train_steps",
        "0",
        "--enable_progress_bar",
        "False",
        "--checkpoint.no_save",
        "--gen_savedir",
        str(tmp / "gen"),
        "--snapshot_dir",
        str(Path(args.snapshot_parent) / f"nnscaler-bench-{os.getpid()}"),
        *snapshots,
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of each run's median")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--plan", type=int, default=2)
    parser.add_argument("--runtime", type=int, default=4)
    parser.add_argument(
        "--every",
        default="auto",
        help="snapshot_every of the runs with snapshots: a number, or auto (the default under torchrun "
        "--max-restarts: every step where it costs at most 5%% of a step, else the interval where it does)",
    )
    parser.add_argument("--snapshot-parent", default="/dev/shm")
    parser.add_argument(
        "--ranks-per-node",
        type=int,
        default=2,
        help="simulated nodes of this many ranks (peer copies between them)",
    )
    args = parser.parse_args(argv)
    env = {"LOCAL_WORLD_SIZE": str(args.ranks_per_node), "TORCHELASTIC_MAX_RESTARTS": "3"}  # as torchrun
    times: dict[str, list[float]] = {"off": [], "on": []}
    sizes: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="snapshot-bench-") as tmp:
        for _ in range(args.rounds):
            for name, every in (("off", "0"), ("on", args.every)):
                results = spawn(_run, args.runtime, tmp, _argv(args, Path(tmp), every), env, timeout=1800)
                times[name] += [t for r in results for t in r["step_times"][args.warmup :]]
                if name == "on":
                    sizes = results[0]
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    per_node = sizes.get("ranks_per_node") or 1
    print(
        json.dumps(
            {
                "model": "examples/nanogpt/train_cli.yaml (n_layer 4, n_embd 128, block 64, micro batch 16)",
                "plan_ngpus": args.plan,
                "runtime_ngpus": args.runtime,
                "snapshot_every": args.every,
                "snapshot_every_chosen": sizes.get("every_at_end"),
                "steps_timed": {k: len(v) for k, v in times.items()},
                "step_time_s_without": round(off, 5),
                "step_time_s_with": round(on, 5),
                "ratio": round(on / off, 4),
                "snapshot_bytes_per_rank": sizes.get("snapshot_bytes"),
                "bytes_kept_per_rank_at_most": sizes.get("kept_bytes_bound_per_rank"),
                "bytes_kept_per_rank_seen": (sizes.get("peak_dir_bytes") or 0) // per_node,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
