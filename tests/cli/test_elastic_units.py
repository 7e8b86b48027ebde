"""The pieces of elastic training that need no process group: re-planning for a new world size, the
snapshot directory's inventory, which step a set of surviving nodes can resume from, and defaults."""

from __future__ import annotations

import pytest

from nnscaler.cli.elastic import nearest_plan_size, replan, resolved_snapshot_every, store
from nnscaler.cli.elastic.restore import Survey
from nnscaler.cli.trainer_args import TrainerArgs
from nnscaler.errors import ConfigError
from tests.cli.common import gpt_args


def test_plan_size_kept_when_it_divides_the_new_world_else_the_nearest_divisor():
    assert nearest_plan_size(2, 2) == 2
    assert nearest_plan_size(6, 4) == 3
    assert nearest_plan_size(3, 2) == 1  # 1 and 3 are as near: the smaller
    assert nearest_plan_size(8, 16) == 8


def _args(tmp_path, runtime=4, **extra):
    argv = gpt_args(tmp_path, "tp", 2, runtime, global_batch_size=8, micro_batch_size=2, **extra)
    return TrainerArgs.from_cli(argv + ["--grad_accumulation_steps!"])


def test_replan_keeps_the_global_batch_and_adjusts_accumulation(tmp_path):
    args = _args(tmp_path)
    assert args.update_freq == 2
    new, line = replan(args, 2)
    assert (new.compute_config.runtime_ngpus, new.compute_config.plan_ngpus) == (2, 2)
    assert (new.global_batch_size, new.update_freq, new.gen_reuse) == (8, 4, "moo")
    assert "grad_accumulation_steps 2 -> 4" in line and "plan_ngpus 2 (kept)" in line
    assert replan(args, 4) == (args, None)


def test_replan_names_the_world_when_no_plan_keeps_the_global_batch(tmp_path):
    with pytest.raises(ConfigError, match=r"elastic restart on 3 ranks.*global_batch_size \(8\)"):
        replan(_args(tmp_path), 3)


def test_inventory_lists_only_complete_rank_files(tmp_path):
    store.write_rank(tmp_path, 5, 0, b"x", {"world_size": 2, "holder": "own"})
    (store.step_dir(tmp_path, 5) / "1.ckpt").write_bytes(b"half written, no description yet")
    assert store.inventory(tmp_path) == {5: {0: {"world_size": 2, "holder": "own"}}}
    assert store.reached_step(tmp_path) == 5
    store.prune_before(tmp_path, 6, keep=5)
    assert store.reached_step(tmp_path) == 5
    store.clear(tmp_path)
    assert store.inventory(tmp_path) == {}


def _meta(holder, world=4, node=0):
    return {"world_size": world, "holder": holder, "node": node}


def test_newest_step_complete_over_the_surviving_nodes():
    survivor = {
        7: {0: _meta("own"), 1: _meta("own"), 2: _meta("peer", node=1)},  # rank 3's copy never arrived
        6: {0: _meta("own"), 1: _meta("own"), 2: _meta("peer", node=1), 3: _meta("peer", node=1)},
    }
    other = {7: {3: _meta("own", node=1)}}
    found = Survey(nodes={"a": survivor}, reached=7)
    assert found.complete_step() == 6 and found.lost_ranks(6) == [2, 3] and found.lost_nodes(6) == [1]
    found = Survey(nodes={"a": survivor, "c": other}, reached=7)
    assert found.complete_step() == 7 and found.lost_ranks(7) == [2]
    assert found.lost_nodes(7) == [1]
    mixed = {8: {0: _meta("own", 2), 1: _meta("own", 4)}}  # files of two different worlds
    assert Survey(nodes={"a": mixed}, reached=8).complete_step() is None


def test_snapshot_every_defaults_to_every_step_only_under_a_restarting_agent(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCHELASTIC_MAX_RESTARTS", raising=False)
    assert resolved_snapshot_every(None) == 0
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    assert resolved_snapshot_every(None) == 1 and resolved_snapshot_every(0) == 0
    with pytest.raises(ConfigError, match="snapshot_every must be >= 0"):
        _args(tmp_path, snapshot_every=-1)


def test_auto_interval_keeps_snapshots_within_five_percent_of_the_training_time(tmp_path):
    from nnscaler.cli.elastic.membership import Membership
    from nnscaler.cli.elastic.snapshot import SnapshotWriter

    member = Membership(rank=0, world_size=1, local_world_size=1, restart_count=0, run_id="t")
    writer = SnapshotWriter(1, tmp_path, member, None, auto=True)
    assert writer._proposed_every(0.001, 0.004) == 1  # nothing timed yet: every step
    writer.quiet_seconds = [0.1, 0.1, 0.1]
    assert writer._proposed_every(0.001, 0.004) == 1  # 5 ms of a 100 ms step: fits
    writer.busy_seconds = [0.2]  # a step with a write in it took 100 ms longer
    assert writer._proposed_every(0.001, 0.004) == 21  # 101 ms every 21 steps of 100 ms: under 5%
