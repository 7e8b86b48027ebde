"""Crash consistency: each writer SIGKILLed at 20 points of a write; the next run loads the previous
complete state (or the new one, past the commit point), and says what an interrupted write left.

The writers are forked from this process (tests.crash.killer), so a kill point costs milliseconds.
Longer runs: `python benchmarks/crash_consistency.py --points 200`.
"""

from __future__ import annotations

import os

import pytest

from tests.crash.killer import Point, count_points, run_killed, spread_points
from tests.crash.runner import run_scenario
from tests.crash.writers import make

POINTS = 20


def test_the_killer_stops_a_writer_at_an_operation_and_inside_a_write(tmp_path):
    target = tmp_path / "f.bin"

    def write() -> None:
        with open(target, "wb") as f:
            f.write(b"x" * 1000)
        os.replace(target, tmp_path / "g.bin")

    trace = count_points(write)
    assert trace.nbytes == 1000 and [op.split(":")[0] for op in trace.ops] == ["open", "write", "replace"]
    (tmp_path / "g.bin").unlink()
    assert run_killed(write, Point(op=2)).killed and target.read_bytes() == b"x" * 1000  # before replace
    assert run_killed(write, Point(nbytes=300)).killed and target.stat().st_size == 300
    assert not (tmp_path / "g.bin").exists()
    assert not run_killed(write, Point(op=3)).killed and (tmp_path / "g.bin").exists()
    points = spread_points(trace, 4)
    assert Point(op=1) in points and Point(op=2) in points and any(p.nbytes for p in points)


@pytest.mark.parametrize("writer", ["trainer", "runtime", "hf_export", "codegen"])
def test_a_killed_writer_leaves_a_complete_state(tmp_path, writer, capsys):
    scenario = make(writer)
    result = run_scenario(scenario, tmp_path / writer, POINTS)
    capsys.readouterr()  # the Trainer's progress lines
    assert result.points == POINTS and result.killed == POINTS
    assert not result.failures, "\n".join(result.failures)
    # the points straddle the commit: some kills keep the previous state, later ones the new one
    assert result.outcomes.get("previous", 0) > 0, result.outcomes
    assert result.outcomes.get("new", 0) + result.outcomes.get("regenerate", 0) > 0, result.outcomes
    if writer == "codegen":  # the last kill was inside the last file written (the fingerprint's)
        assert any("interrupted compile" in line for line in scenario.next_run())
