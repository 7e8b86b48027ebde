"""Fault drills under torchrun's elastic agent on one machine: simulated nodes are agents with their
own snapshot directory ($NNSCALER_SNAPSHOT_DIR), run as `torchrun ... -m tests.cli.elastic_harness`.

Environment of a drill worker: DRILL_OUT (a directory for loss records and pid files), DRILL_NODE (the
simulated node's name), DRILL_KILL_NODE / DRILL_KILL_STEP (those nodes' workers, comma-separated names,
stop after that step, once, and wait to be SIGKILLed by the driver (`kill_node`) or restarted by
their agent when another node joins).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nnscaler.cli.train_hook import TrainHook

REPO = Path(__file__).resolve().parents[2]


class DrillHook(TrainHook):
    """Records each step's loss (with the restart it ran in) and freezes the victim node on cue."""

    def on_train_start(self, trainer: Any) -> None:
        out = _out() / f"pids-{os.environ['DRILL_NODE']}"
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{trainer.rank}.pid").write_text(str(os.getpid()))

    def on_step_end(self, trainer: Any, epoch: int, idx: int, metrics: dict, agg: Any) -> None:
        step = trainer.train_status["step"]
        restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        node = os.environ["DRILL_NODE"]
        record = {
            "step": step,
            "loss": metrics["train/loss"],
            "restart": restart,
            "world": trainer.world_size,
            "pid": os.getpid(),
        }
        record.update({k: v for k, v in metrics.items() if k.startswith("elastic/")})
        with open(_out() / f"losses-{node}-{trainer.rank}.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        time.sleep(float(os.environ.get("DRILL_STEP_SLEEP") or 0))  # longer steps, for the kill drills
        marker = _out() / f"frozen-{node}-{trainer.rank}"
        victims = os.environ.get("DRILL_KILL_NODE", "").split(",")
        if node in victims and step == int(os.environ["DRILL_KILL_STEP"]) and not marker.exists():
            marker.write_text(str(step))
            time.sleep(600)  # the driver kills the node now (or a joining node restarts it)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def node_records(out: Path, node: str) -> list[dict[str, Any]]:
    """Every loss record of a simulated node's workers, in the order each worker wrote them."""
    records = []
    for path in sorted(out.glob(f"losses-{node}-*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines()]
    return records


def _out() -> Path:
    return Path(os.environ["DRILL_OUT"])


def start_agent(
    node: str,
    port: int,
    out: Path,
    argv: list[str],
    *,
    nnodes: str = "1:2",
    env: dict | None = None,
    max_restarts: int = 3,
) -> subprocess.Popen:
    """One simulated node: a torchrun elastic agent with 2 workers, in a session of its own."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nnodes}",
        "--nproc-per-node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{port}",
        "--rdzv-id=drill",
        "--rdzv-conf=last_call_timeout=4,join_timeout=120",
        f"--max-restarts={max_restarts}",
        "--monitor-interval=0.2",
        "-m",
        "tests.cli.elastic_harness",
        *argv,
    ]
    full_env = {
        **os.environ,
        **(env or {}),
        "DRILL_OUT": str(out),
        "DRILL_NODE": node,
        "NNSCALER_SNAPSHOT_DIR": str(out / f"shm-{node}"),
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        # torch's shared agent store keeps the previous round's keys: a restarted round's process
        # group would connect to the dead round's addresses (docs/elastic.md)
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    log = open(out / f"agent-{node}.log", "a")
    return subprocess.Popen(
        cmd, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def wait_for(path_glob: str, out: Path, count: int, timeout: float, agents: list[subprocess.Popen]) -> None:
    """Until `count` files match `path_glob` under `out` (an agent ending first fails the drill)."""
    deadline = time.monotonic() + timeout
    while len(list(out.glob(path_glob))) < count:
        if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
            raise AssertionError(f"drill: {path_glob} did not appear; logs: {agent_logs(out)}")
        time.sleep(0.2)


def kill_node(node: str, agent: subprocess.Popen, out: Path) -> None:
    """SIGKILL a simulated node: its agent and every worker (workers run in sessions of their own)."""
    os.killpg(agent.pid, signal.SIGKILL)
    for pid_file in (out / f"pids-{node}").glob("*.pid"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
    agent.wait()


def agent_logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-20000:]}" for p in sorted(out.glob("agent-*.log")))


def losses(out: Path, node: str, rank: int = 0) -> list[dict[str, Any]]:
    """The loss records of one worker slot, in order (a restarted worker appends to the same file)."""
    path = out / f"losses-{node}-{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def final_losses(records: list[dict[str, Any]]) -> dict[int, float]:
    """Step -> loss of the last run of each step (a redone step keeps its redone loss)."""
    return {r["step"]: r["loss"] for r in records}


if __name__ == "__main__":
    from nnscaler.cli import Trainer

    Trainer(sys.argv[1:]).run()
