"""The standard-recipe table takes the request's micro-batch count (issue 42): with `--nmicros 16`,
every recipe runs 16 micro-batches as the chosen plan does, so their step times compare like for like.
Before, recipes tried only 1, 4, 16 or 64 micro-batches that fit the traced batch (here 1), and a
recipe at 1 micro-batch looked 7x faster than the plan it was set beside."""

from __future__ import annotations

import re

from tests.settings.test_plan_cli_table import BASE, run_cli


def _recipe_micros(stdout: str) -> list[int]:
    rows = [line for line in stdout.splitlines() if line.startswith(("| DP x", "| Megatron"))]
    assert rows, stdout
    return [int(re.search(r", (\d+) micro-batches", row).group(1)) for row in rows]


def test_recipes_run_the_requested_micro_batches():
    code, stdout, _ = run_cli([*BASE, "--nmicros", "16"])
    assert code == 0
    assert "nmicros=16" in stdout
    assert set(_recipe_micros(stdout)) == {16}


def test_recipes_choose_their_own_without_a_request():
    code, stdout, _ = run_cli(BASE)
    assert code == 0
    assert 16 not in _recipe_micros(stdout)  # the traced batch leaves one micro-batch per replica
