"""Kill a writer at points spread over its write and check what is left after each kill.

A `Scenario` builds a previous complete state under a directory (`setup`), writes a new one
(`write`, run in a forked child by tests.crash.killer) and, after a kill, says which state the next
run found (`check`: "previous", "new" or "regenerate"; AssertionError when neither loads right).
`run_scenario` restores the previous state before every point, so each kill starts from it.
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tests.crash.killer import Point, count_points, run_killed, spread_points

__all__ = ["Scenario", "Result", "run_scenario"]


class Scenario(Protocol):
    name: str
    state_dir: Path
    """The directory the writer writes into (restored before every point)."""

    def setup(self, root: Path) -> None: ...

    def write(self) -> None: ...

    def learn_new(self) -> None:
        """After a write that was not killed: record the new complete state."""

    def check(self) -> str: ...


@dataclass
class Result:
    writer: str
    ops: int
    bytes: int
    points: int = 0
    killed: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def recovered(self) -> bool:
        return self.points > 0 and not self.failures

    def to_dict(self) -> dict:
        return {
            "writer": self.writer,
            "operations": self.ops,
            "bytes": self.bytes,
            "points_tried": self.points,
            "killed": self.killed,
            "recovered_to": dict(sorted(self.outcomes.items())),
            "failures": self.failures,
            "all_recovered": self.recovered,
            "seconds": round(self.seconds, 2),
        }


def _restore(pristine: Path, target: Path) -> None:
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(pristine, target, symlinks=True)


def _where(point: Point, ops: list[str]) -> str:
    if point.op is not None:
        return f"{point} (before {[op for op in ops if not op.startswith('write:')][point.op - 1]})"
    return str(point)


def run_scenario(scenario: Scenario, root: Path, points: int) -> Result:
    """Set up, dry-run (count the operations, check the new state), then kill at `points` points."""
    start = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    scenario.setup(root)
    pristine = root / "pristine"
    shutil.copytree(scenario.state_dir, pristine, symlinks=True)
    trace = count_points(scenario.write)
    scenario.learn_new()
    result = Result(scenario.name, len(trace.ops), trace.nbytes)
    assert scenario.check() == "new", f"{scenario.name}: a write that was not killed must load as new"
    for point in spread_points(trace, points):
        _restore(pristine, scenario.state_dir)
        outcome = run_killed(scenario.write, point)
        result.points += 1
        result.killed += outcome.killed
        try:
            found = scenario.check()
        except AssertionError as err:
            result.failures.append(f"killed at {_where(point, trace.ops)}: {err}")
            continue
        result.outcomes[found] = result.outcomes.get(found, 0) + 1
    result.seconds = time.perf_counter() - start
    return result
