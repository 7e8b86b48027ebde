"""Fault drill under torchrun's elastic agent (CPU, gloo): 2 simulated nodes x 2 ranks, tp 2 x dp 2 with
in-memory snapshots every step; one node is SIGKILLed after a random step. The survivor restarts alone
(tp 2 x dp 1), resumes from the newest complete snapshot (its own ranks' files and the peer copies of
the dead node's), redoes at most one step, and its losses equal a run that changed world size at that
step by plan (a disk checkpoint under 4 ranks resumed under 2)."""

from __future__ import annotations

import random
import socket
import time

import pytest

from nnscaler.cli import Trainer
from tests.cli.common import gpt_args
from tests.cli.elastic_harness import agent_logs, kill_node, losses, start_agent, wait_for
from tests.dist_util import spawn

STEPS = 7


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _argv(tmp, node: str, runtime: int = 4, steps: int = STEPS, **extra) -> list[str]:
    argv = gpt_args(
        tmp,
        "tp",
        2,
        runtime,
        max_train_steps=steps,
        global_batch_size=8,
        micro_batch_size=2,
        **{"checkpoint.every_n_train_steps": 100, **extra},
    )
    argv += ["--grad_accumulation_steps!", "--gen_savedir", str(tmp / f"gen-{node}")]
    return argv


def _node_records(out, node: str) -> list[dict]:
    return sorted(
        (r for rank in range(4) for r in losses(out, node, rank)), key=lambda r: (r["restart"], r["step"])
    )


def _train(rank: int, world: int, argv: list[str]) -> list[float]:
    trainer = Trainer(argv)
    trainer.run()
    return trainer.losses


def test_node_lost_mid_run_resumes_from_memory_on_the_survivor(tmp_path):
    kill_step = random.Random(time.time_ns()).randint(2, 4)
    print("killing node b after step", kill_step)
    port = _free_port()
    drill = {"snapshot_every": 1, "hook.type": "tests.cli.elastic_harness.DrillHook"}
    env = {"DRILL_KILL_NODE": "b", "DRILL_KILL_STEP": str(kill_step)}
    a = start_agent("a", port, tmp_path, _argv(tmp_path, "a", **drill), env=env)
    time.sleep(1.0)  # node a hosts the rendezvous store (losing its host is not survived)
    b = start_agent("b", port, tmp_path, _argv(tmp_path, "b", **drill), env=env)
    try:
        wait_for("frozen-b-*", tmp_path, 2, 150, [a, b])
        kill_node("b", b, tmp_path)
        assert a.wait(timeout=150) == 0, agent_logs(tmp_path)
    finally:
        for agent in (a, b):
            if agent.poll() is None:
                agent.kill()
    log = agent_logs(tmp_path)
    records = _node_records(tmp_path, "a")
    first = [r for r in records if r["restart"] == 0]
    after = [r for r in records if r["restart"] == 1]
    assert max(r["world"] for r in first) == 4 and {r["world"] for r in after} == {2}, log
    resumed = after[0]["step"] - 1
    redone = max(r["step"] for r in first) - resumed
    assert 0 <= redone <= 1, log
    assert after[-1]["step"] == STEPS
    assert after[0]["elastic/restarts"] == 1 and after[0]["elastic/redone_steps"] == redone
    assert "in-memory snapshot" in log and "lost ranks" in log and "new plan for 2 ranks" in log, log
    assert "grad_accumulation_steps 2 -> 4" in log

    # the same world change by plan: 4 ranks to the resumed step, a disk checkpoint, 2 ranks on
    # (the code generated for 4 ranks by node b and for 2 by node a is reused: generation is deterministic)
    ref = tmp_path / "ref"
    ref.mkdir()
    before = spawn(
        _train, 4, ref, _argv(ref, "r4", steps=resumed) + ["--gen_savedir", str(tmp_path / "gen-b")]
    )[0]
    last = str(ref / "ckpt" / "last")
    rest_argv = _argv(ref, "r2", runtime=2, **{"checkpoint.resume_from": last})
    rest = spawn(_train, 2, ref, rest_argv + ["--gen_savedir", str(tmp_path / "gen-a")])[0]
    drill_losses = {r["step"]: r["loss"] for r in records}  # a redone step keeps its second loss
    expected = dict(enumerate(before + rest, start=1))
    assert drill_losses.keys() == expected.keys()
    for step, loss in expected.items():
        assert drill_losses[step] == pytest.approx(loss, abs=1e-6, rel=1e-6), (step, drill_losses, expected)
