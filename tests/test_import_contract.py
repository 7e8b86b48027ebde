"""The import direction of DESIGN.md §2 holds (import-linter contracts in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _lint_imports_command() -> list[str]:
    exe = Path(sys.executable).with_name("lint-imports")
    if exe.exists():
        return [str(exe)]
    found = shutil.which("lint-imports")
    assert found, "lint-imports (import-linter) is not installed: pip install -e .[test]"
    return [found]


def test_import_contracts_hold() -> None:
    proc = subprocess.run(
        [*_lint_imports_command(), "--no-cache"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, (
        f"lint-imports failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    )
