"""A longer fault drill under torchrun's elastic agent: kill a node N times, bring it back each time.

    python benchmarks/elastic_drill.py --kills 10 [--step-sleep 0.5]

Two simulated nodes of 2 CPU ranks each (two torchrun agents on this machine, c10d rendezvous, each
with its own snapshot directory) train the tests' tiny GPT with tp 2 x dp 2 and a snapshot every
step. Each round: node b's agent and workers are SIGKILLed at a random moment of a step; node a's
workers restart alone (tp 2 x dp 1) from the in-memory snapshots; then node b starts again with empty
memory and joins (dp 1 -> 2). `--step-sleep` lengthens every step (seconds) so that kills land
mid-run. Prints one JSON object: per kill the step it landed after, the step resumed from, the steps
redone, the seconds from the kill to the survivor's first finished step, and the seconds from the
rejoin to the first step on both nodes; and their totals.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from tests.cli.common import gpt_args  # noqa: E402
from tests.cli.elastic_harness import agent_logs, free_port, kill_node, node_records, start_agent  # noqa: E402


def _argv(tmp: Path, node: str, steps: int) -> list[str]:
    argv = gpt_args(
        tmp,
        "tp",
        2,
        4,
        max_train_steps=steps,
        global_batch_size=8,
        micro_batch_size=2,
        snapshot_every=1,
        **{"hook.type": "tests.cli.elastic_harness.DrillHook", "checkpoint.every_n_train_steps": 1000},
    )
    return argv + ["--grad_accumulation_steps!", "--gen_savedir", str(tmp / f"gen-{node}")]


def _records(tmp: Path) -> list[dict[str, Any]]:
    return node_records(tmp, "a") + node_records(tmp, "b")


def _wait(cond, what: str, timeout: float, agents: list, tmp: Path) -> float:
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout or any(a.poll() is not None for a in agents):
            raise RuntimeError(f"elastic drill: {what} did not happen; logs:\n{agent_logs(tmp)}")
        time.sleep(0.05)
    return time.monotonic()


def _one_kill(tmp: Path, a, b, rng: random.Random, step_sleep: float) -> tuple[dict[str, Any], Any]:
    n_before = len(_records(tmp))  # every rank appends one record a step: 8 more are two steps of 4 ranks
    _wait(lambda: len(_records(tmp)) >= n_before + 8, "two steps on both nodes", 300, [a, b], tmp)
    time.sleep(rng.uniform(0, step_sleep))  # somewhere in a step
    last = max(r["step"] for r in node_records(tmp, "a"))
    killed_at = time.monotonic()
    kill_node("b", b, tmp)
    shutil.rmtree(tmp / "shm-b", ignore_errors=True)  # a replacement node comes with empty memory

    seen = {r["pid"] for r in node_records(tmp, "a")}

    def survivor_steps() -> list[dict[str, Any]]:
        return [r for r in node_records(tmp, "a") if r["world"] == 2 and r["pid"] not in seen]

    recovered = _wait(lambda: bool(survivor_steps()), "a step on the survivor", 300, [a], tmp)
    resumed = survivor_steps()[0]["step"] - 1
    port = int((tmp / "port").read_text())
    b = start_agent(
        "b", port, tmp, _argv(tmp, "b", 10**6), env={"DRILL_STEP_SLEEP": str(step_sleep)}, max_restarts=100
    )
    joined_at = time.monotonic()
    before_join = {r["pid"] for r in _records(tmp)}
    rejoined = _wait(
        lambda: any(r["world"] == 4 and r["pid"] not in before_join for r in _records(tmp)),
        "a step on both nodes",
        300,
        [a, b],
        tmp,
    )
    return {
        "killed_after_step": last,
        "resumed_from_step": resumed,
        "steps_redone": last - resumed,
        "seconds_to_first_step_after_kill": round(recovered - killed_at, 2),
        "seconds_to_first_step_after_rejoin": round(rejoined - joined_at, 2),
    }, b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--step-sleep", type=float, default=0.5, help="seconds added to every step")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    kills = []
    with tempfile.TemporaryDirectory(prefix="elastic-drill-") as tmp_name:
        tmp = Path(tmp_name)
        port = free_port()
        (tmp / "port").write_text(str(port))
        env = {"DRILL_STEP_SLEEP": str(args.step_sleep)}
        a = start_agent("a", port, tmp, _argv(tmp, "a", 10**6), env=env, max_restarts=args.kills + 2)
        time.sleep(1.0)  # node a hosts the rendezvous store
        b = start_agent("b", port, tmp, _argv(tmp, "b", 10**6), env=env, max_restarts=100)
        try:
            for _ in range(args.kills):
                result, b = _one_kill(tmp, a, b, rng, args.step_sleep)
                kills.append(result)
                print(json.dumps(result), file=sys.stderr)
        finally:
            for node, agent in (("a", a), ("b", b)):
                if agent.poll() is None:
                    kill_node(node, agent, tmp)
    print(
        json.dumps(
            {
                "kills": len(kills),
                "steps_redone_total": sum(k["steps_redone"] for k in kills),
                "steps_redone_max": max((k["steps_redone"] for k in kills), default=0),
                "seconds_to_first_step_after_kill_mean": round(
                    sum(k["seconds_to_first_step_after_kill"] for k in kills) / max(len(kills), 1), 2
                ),
                "step_sleep_s": args.step_sleep,
                "per_kill": kills,
            },
            indent=1,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
