"""Elastic restarts besides a lost node (CPU, gloo, torchrun's elastic agent): both nodes lost (their
memory with them) resumes from the last disk checkpoint; a node joining mid-run (dp 1 -> 2) makes the
agent restart its workers, which resume from the in-memory snapshot under the bigger plan."""

from __future__ import annotations

import shutil

import pytest

from tests.cli.elastic_harness import agent_logs, free_port, kill_node, node_records, start_agent, wait_for
from tests.cli.test_elastic_drill import STEPS, _argv

DRILL = {"snapshot_every": 1, "hook.type": "tests.cli.elastic_harness.DrillHook"}


def test_both_nodes_lost_resumes_from_the_last_disk_checkpoint(tmp_path):
    argv = {node: _argv(tmp_path, node, **DRILL, **{"checkpoint.every_n_train_steps": 2}) for node in "ab"}
    env = {"DRILL_KILL_NODE": "a,b", "DRILL_KILL_STEP": "3"}
    port = free_port()
    agents = {node: start_agent(node, port, tmp_path, argv[node], env=env) for node in "ab"}
    try:
        wait_for("frozen-*", tmp_path, 4, 150, list(agents.values()))
    finally:
        for node, agent in agents.items():
            kill_node(node, agent, tmp_path)
    before = node_records(tmp_path, "a")
    first = {r["step"]: r["loss"] for r in before}
    assert max(first) == 3
    for node in "ab":  # the nodes' memory is gone with them
        shutil.rmtree(tmp_path / f"shm-{node}")
    port = free_port()
    again = {node: argv[node] + ["--checkpoint.resume_from", "last"] for node in "ab"}
    agents = {node: start_agent(node, port, tmp_path, again[node]) for node in "ab"}
    try:
        for agent in agents.values():
            assert agent.wait(timeout=150) == 0, agent_logs(tmp_path)
    finally:
        for agent in agents.values():
            if agent.poll() is None:
                agent.kill()
    log = agent_logs(tmp_path)
    assert "no complete in-memory snapshot; resuming from disk checkpoint" in log, log
    assert "at step 2" in log
    pids = {r["pid"] for r in before}
    redone = {r["step"]: r["loss"] for r in node_records(tmp_path, "a") if r["pid"] not in pids}
    assert min(redone) == 3 and max(redone) == STEPS
    assert redone[3] == pytest.approx(first[3], rel=1e-6, abs=1e-6)  # the same step, the same plan


def test_node_joins_mid_run_and_training_continues_on_both(tmp_path):
    argv = {node: _argv(tmp_path, node, runtime=2, **DRILL) for node in "ab"}
    env = {"DRILL_KILL_NODE": "a", "DRILL_KILL_STEP": "3"}
    port = free_port()
    a = start_agent("a", port, tmp_path, argv["a"], env=env)
    b = None
    try:
        wait_for("frozen-a-*", tmp_path, 2, 150, [a])
        b = start_agent("b", port, tmp_path, argv["b"], env=env)
        assert a.wait(timeout=150) == 0, agent_logs(tmp_path)
        assert b.wait(timeout=60) == 0, agent_logs(tmp_path)
    finally:
        for agent in (a, b):
            if agent is not None and agent.poll() is None:
                agent.kill()
    log = agent_logs(tmp_path)
    records = node_records(tmp_path, "a") + node_records(tmp_path, "b")
    small = [r for r in records if r["world"] == 2]
    big = [r for r in records if r["world"] == 4]
    assert max(r["step"] for r in small) == 3 and max(r["step"] for r in big) == STEPS, log
    resumed = min(r["step"] for r in big) - 1
    assert 0 <= 3 - resumed <= 1, log
    assert "elastic re-rendezvous" in log and "new plan for 4 ranks" in log, log
    assert "grad_accumulation_steps 4 -> 2" in log and "in-memory snapshot" in log, log
