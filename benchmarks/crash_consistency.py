"""Kill each writer with SIGKILL at many points of a write and check that every kill recovered.

    python benchmarks/crash_consistency.py --points 200 [--writers trainer,runtime,hf_export,codegen]

For each writer (tests/crash/writers.py): the previous complete state is set up, the new write is
dry-run to count its operations and bytes, then killed at `--points` points spread over them (half
before the opens, fsyncs, renames, mkdirs and unlinks, half after byte counts), each time from the
previous state. After each kill the next run must find the previous or the new state complete (or,
for generated code, refuse what it cannot verify and regenerate). Prints one JSON object: per
writer the points tried, how many recovered to each state, and whether all did; exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from tests.crash.runner import run_scenario  # noqa: E402
from tests.crash.writers import SCENARIOS, make  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--points", type=int, default=200, help="kill points per writer")
    parser.add_argument(
        "--writers", default=",".join(SCENARIOS), help=f"comma-separated, of {', '.join(SCENARIOS)}"
    )
    args = parser.parse_args(argv)
    writers = [w.strip() for w in args.writers.split(",") if w.strip()]
    unknown = [w for w in writers if w not in SCENARIOS]
    if unknown or args.points < 1:
        parser.error(f"--writers: unknown {unknown}" if unknown else "--points must be at least 1")
    results = []
    with tempfile.TemporaryDirectory(prefix="crash-") as tmp:
        for name in writers:
            with contextlib.redirect_stdout(io.StringIO()):  # the Trainer's progress lines
                result = run_scenario(make(name), Path(tmp) / name, args.points)
            results.append(result.to_dict())
    ok = all(r["all_recovered"] for r in results)
    print(json.dumps({"points_per_writer": args.points, "writers": results, "all_recovered": ok}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
