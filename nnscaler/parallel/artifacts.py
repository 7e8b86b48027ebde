"""The record of what a compile wrote, and the checks that generated files are still those files.

When a compile finishes, `fingerprint.json` is written last; besides what the code was generated
for (see `nnscaler.parallel.fingerprint`) it holds, under "artifacts", the size and sha256 of every
file the compile wrote: `gencode{rank}.py` for every rank, `plan.json`, `graph.json`,
`compute_config.json` and `constants.pt` (when the forward makes constants). A directory without a
readable fingerprint is an unfinished compile.

Before generated code is reused, and before a rank imports its `gencode{rank}.py`, the files are
compared with that record: an edited, truncated, missing or swapped file is named instead of run.
The record catches accidents and edits (a hand-patched gencode, a half-copied directory, files of
two compiles mixed); it is not a signature: whoever can write the directory can rewrite the record
too (docs/security.md).
"""

from __future__ import annotations

import hashlib
import io
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nnscaler.errors import ConfigError
from nnscaler.parallel.savedir import (
    COMPUTE_CONFIG_FILE,
    CONSTANTS_FILE,
    FINGERPRINT_FILE,
    GRAPH_FILE,
    PLAN_FILE,
)

__all__ = [
    "ARTIFACTS_KEY",
    "CODE_SUPPORT_FILES",
    "SavedFingerprint",
    "read_saved",
    "artifact_names",
    "record_artifacts",
    "check_artifacts",
    "check_file",
    "read_verified",
    "torch_bytes",
    "sha256",
    "verified_code",
    "LOAD_HINT",
    "is_generated_name",
    "stale_code_files",
]

ARTIFACTS_KEY = "artifacts"
"""Key of fingerprint.json holding {file name: {"sha256": hex, "bytes": size}}."""

CODE_SUPPORT_FILES = (COMPUTE_CONFIG_FILE, CONSTANTS_FILE)
"""Files a rank reads besides its gencode to construct its module (verified with it)."""

_ALWAYS = (PLAN_FILE, GRAPH_FILE, COMPUTE_CONFIG_FILE)
_GENERATED = re.compile(
    r"gencode\d+\.py|fullmodel\.pt(\.\d+)?|fingerprint\.json|graph\.json|plan\.json|compute_config\.json"
    r"|constants\.pt|plan_report\.md"
)


def is_generated_name(name: str) -> bool:
    """Whether `name` is one nnscaler writes into an output directory (`gencode3.py`, `plan.json`, ...).

    Only such files are ever removed or replaced by the compile and by the broadcast of generated
    files; any other file a user keeps there (`notes.txt`, `gencode_old.py`) is left alone.
    """
    return _GENERATED.fullmatch(name) is not None


def stale_code_files(outdir: Path, runtime_ngpus: int) -> list[Path]:
    """`gencode{rank}.py` files of ranks a compile for `runtime_ngpus` ranks does not have."""
    out = []
    for path in outdir.glob("gencode*.py"):
        m = re.fullmatch(r"gencode(\d+)\.py", path.name)
        if m and int(m.group(1)) >= runtime_ngpus and path.is_file():
            out.append(path)
    return sorted(out)


@dataclass(frozen=True)
class SavedFingerprint:
    """fingerprint.json as found: `data` when it parses, else `problem` says why not (None: absent)."""

    data: dict[str, Any] | None
    problem: str | None = None

    @property
    def artifacts(self) -> dict[str, dict] | None:
        record = (self.data or {}).get(ARTIFACTS_KEY)
        return record if isinstance(record, dict) else None


def read_saved(outdir: Path) -> SavedFingerprint:
    """Read fingerprint.json; a damaged one is reported, never raised as a JSONDecodeError."""
    path = outdir / FINGERPRINT_FILE
    try:
        text = path.read_bytes().decode("utf-8")
    except FileNotFoundError:
        return SavedFingerprint(None)
    except (OSError, UnicodeDecodeError) as exc:
        return SavedFingerprint(None, f"{path} cannot be read ({exc})")
    try:
        data = json.loads(text)
    except ValueError as exc:
        return SavedFingerprint(None, f"{path} is not valid JSON ({exc}): it is damaged or truncated")
    if not isinstance(data, dict):
        return SavedFingerprint(None, f"{path} holds a {type(data).__name__}, not a fingerprint")
    return SavedFingerprint(data)


def artifact_names(outdir: Path, runtime_ngpus: int) -> list[str]:
    """The files a compile for `runtime_ngpus` ranks writes to `outdir`."""
    names = [f"gencode{rank}.py" for rank in range(runtime_ngpus)] + list(_ALWAYS)
    if (outdir / CONSTANTS_FILE).exists():
        names.append(CONSTANTS_FILE)
    return names


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def record_artifacts(outdir: Path, names: list[str]) -> dict[str, dict]:
    """Size and sha256 of each named file (all must exist)."""
    record = {}
    for name in names:
        data = (outdir / name).read_bytes()
        record[name] = {"sha256": sha256(data), "bytes": len(data)}
    return record


def check_file(name: str, data: bytes | None, record: dict[str, dict] | None) -> str | None:
    """What is wrong with file `name` holding `data` (None: absent) against `record`, or None."""
    expected = (record or {}).get(name)
    if not isinstance(expected, dict) or "sha256" not in expected:
        return f"{name} is not in the record of generated files"
    if data is None:
        return f"{name} is missing"
    if sha256(data) == expected["sha256"]:
        return None
    size = expected.get("bytes")
    if isinstance(size, int) and len(data) < size:
        return f"{name} is truncated ({len(data)} of {size} bytes)"
    return f"{name} is not the file that was generated (its sha256 differs: it was edited or replaced)"


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def check_artifacts(outdir: Path, record: dict[str, dict] | None, names: list[str]) -> list[str]:
    """One line per named file that does not match `record` (empty when all do)."""
    problems = [check_file(name, _read(outdir / name), record) for name in names]
    return [p for p in problems if p]


def read_verified(outdir: Path, name: str, record: dict[str, dict] | None, what_to_do: str) -> bytes:
    """The bytes of `outdir/name`, checked against `record` (one read: what is checked is what is used).
    Raises ConfigError naming the file and `what_to_do`."""
    data = _read(outdir / name)
    problem = check_file(name, data, record)
    if problem:
        raise ConfigError(f"{outdir / name}: {problem}. {what_to_do}")
    return data  # type: ignore[return-value]


def torch_bytes(obj: Any) -> bytes:
    """What torch.save writes for `obj` (so it can be written atomically, like every other file)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


LOAD_HINT = (
    "Generated files must not be edited: regenerate them with reuse='moo' (or 'override'), or delete the "
    "directory; if the ranks do not share gen_savedir's disk, pass broadcast_strategy='code' so that rank "
    "0 sends its files"
)


def verified_code(outdir: Path, rank: int, record: dict[str, dict] | None = None) -> str:
    """The text of gencode{rank}.py, checked (with the files constructing its module reads) against
    `record`, or against outdir's fingerprint.json when None. ConfigError naming the file otherwise."""
    if record is None:
        saved = read_saved(outdir)
        record = saved.artifacts
        if record is None:
            why = saved.problem or f"{outdir / FINGERPRINT_FILE} is missing or records no generated files"
            raise ConfigError(
                f"{why}, so {outdir / f'gencode{rank}.py'} cannot be checked before it is imported. {LOAD_HINT}"
            )
    data = read_verified(outdir, f"gencode{rank}.py", record, LOAD_HINT)
    for name in CODE_SUPPORT_FILES:
        if name in record:
            read_verified(outdir, name, record, LOAD_HINT)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:  # only when the record itself was written for such a file
        raise ConfigError(f"{outdir / f'gencode{rank}.py'} is not UTF-8 text ({exc}). {LOAD_HINT}") from exc
