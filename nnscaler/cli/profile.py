"""The profiling command, `python -m nnscaler.profiler`: time a model's ops on this machine's device
(CPU or the current CUDA device) into the JSON database that `pas_config['profile_db_path']` hands
to autodist's search in place of the analytic figures (nnscaler.policies.autodist.profiler).

    python -m nnscaler.profiler --model tests.zoo.build_gpt --ways 1,2 --out ops.json

`--model` and `--hf-config` are read by `nnscaler.cli.model_builder`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from nnscaler.cli.model_builder import build_model
from nnscaler.policies.autodist.profiler import ProfileDB, profile_module

__all__ = ["main"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m nnscaler.profiler", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--model", help="dotted builder returning (module, make_batch or inputs), e.g. tests.zoo.build_gpt"
    )
    ap.add_argument("--hf-config", help="a transformers config.json (weights are not needed)")
    ap.add_argument("--batch", type=int, default=4, help="batch of the dummy input")
    ap.add_argument("--seq", type=int, default=2048, help="sequence length (with --hf-config)")
    ap.add_argument("--ways", default="1,2", help="split degrees to time each op at, e.g. 1,2,4")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default=None, help="'cpu' or 'cuda' (default: cuda where available)")
    ap.add_argument("--out", required=True, help="the database to write (entries are added to it)")
    args = ap.parse_args(argv)
    if not args.model and not args.hf_config:
        ap.error("give --model or --hf-config")
    module, inputs = build_model(args.model, args.hf_config, args.batch, args.seq)
    db = ProfileDB.load(args.out) if Path(args.out).exists() else None
    t0 = time.perf_counter()
    ways = tuple(int(w) for w in args.ways.split(","))
    db = profile_module(module, inputs, ways, args.repeats, args.device, db)
    db.save(args.out)
    print(f"{len(db.entries)} op timings on {db.device} in {args.out} ({time.perf_counter() - t0:.1f}s)")


if __name__ == "__main__":
    main()
