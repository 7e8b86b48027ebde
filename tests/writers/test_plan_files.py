"""Plan files and plan reports are written atomically beside the user's files (issue 41).

autodist's `save_plan`, its `plan_report.md` and `python -m nnscaler.plan --out` write one file each:
a SIGKILL at any point of a rewrite leaves the previous file or the new one whole, never a part, and
every other file in the directory stays byte-identical. A truncated plan file is refused naming it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from nnscaler.errors import PlanError
from nnscaler.policies.autodist.plan_files import load_plan, save_plan
from nnscaler.policies.plan import NodePlan, Plan
from tests.crash.killer import count_points, run_killed, spread_points
from tests.writers.common import assert_kept, plant


def _plan(ngpus: int) -> Plan:
    return Plan(policy="autodist", plan_ngpus=ngpus, nodes={"linear": NodePlan()}, notes=("n" * 4000,))


def _kill_everywhere(restore, write, check) -> int:
    """Run `write` killed at points spread over it (after `restore()` each time; the dry run that
    counts the points writes too); `check()` after each kill. Returns the points killed."""
    trace = count_points(write)
    killed = 0
    for point in spread_points(trace, 12):
        restore()
        killed += run_killed(write, point).killed
        check()
    return killed


def test_a_killed_save_plan_leaves_the_old_plan_or_the_new_one(tmp_path):
    kept = plant(tmp_path)
    path = tmp_path / "plan.json"
    save_plan(_plan(2), path)
    seen: set[int] = set()

    def check() -> None:
        seen.add(load_plan(path).plan_ngpus)  # a half-written file would raise here
        assert_kept(tmp_path, kept)

    assert _kill_everywhere(lambda: save_plan(_plan(2), path), lambda: save_plan(_plan(4), path), check) >= 10
    assert seen == {2, 4}  # kills before the rename keep the old plan whole, the last ones the new
    save_plan(_plan(4), path)
    assert load_plan(path).plan_ngpus == 4
    assert_kept(tmp_path, kept)


def test_a_killed_report_leaves_the_old_report_whole(tmp_path):
    from nnscaler.atomic_files import write_atomic

    kept = plant(tmp_path)
    report = tmp_path / "plan_report.md"
    old = "# old report\n" + "row\n" * 2000
    report.write_text(old)
    new = "# new report\n" + "line\n" * 2000

    # write_plan_report and `--out` both write through write_atomic
    seen: set[str] = set()

    def check() -> None:
        seen.add(report.read_text())
        assert_kept(tmp_path, kept)

    assert _kill_everywhere(lambda: report.write_text(old), lambda: write_atomic(report, new), check) >= 10
    assert seen <= {old, new} and old in seen


def test_plan_cli_out_writes_beside_the_users_files(tmp_path):
    from tests.settings.test_plan_cli_table import BASE, run_cli

    kept = plant(tmp_path)
    out = tmp_path / "report.md"
    code, stdout, _ = run_cli([*BASE, "--out", str(out)])
    assert code == 0
    assert out.read_text() == stdout
    assert_kept(tmp_path, kept)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        {"report.md", *{Path(r).parts[0] for r in kept}}
    )


@pytest.mark.parametrize("damage", [lambda text: text[: len(text) // 2], lambda text: "\x00\xff" + text])
def test_a_truncated_plan_file_is_refused_naming_it(tmp_path, damage):
    path = tmp_path / "plan.json"
    save_plan(_plan(2), path)
    path.write_text(damage(path.read_text()), errors="surrogateescape")
    with pytest.raises(PlanError, match=r"plan file .*plan\.json cannot be read.*save the plan again"):
        load_plan(path)
