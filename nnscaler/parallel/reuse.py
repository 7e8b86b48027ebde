"""Whether rank 0 generates code again, reuses what is on disk, or replans from the saved graph.

`decide` reads fingerprint.json (a damaged one is never a JSONDecodeError), compares it with this
call's fingerprint, and checks the generated files against the sha256 it records:

- 'match': reuse when everything matches; otherwise raise ConfigError naming what differs or which
  file is damaged, and saying how to regenerate;
- 'moo': reuse when everything matches; otherwise regenerate;
- 'override': always regenerate;
- 'graph': check graph.json (and constants.pt) against the record and the model, then plan and
  generate again from it.

No fingerprint at all means nothing complete was written (the fingerprint is written last): generate.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from nnscaler.codegen import write_atomic
from nnscaler.config import ComputeConfig, ReuseType
from nnscaler.errors import ConfigError
from nnscaler.graph.ir import Graph, graph_from_json
from nnscaler.parallel.artifacts import (
    ARTIFACTS_KEY,
    CODE_SUPPORT_FILES,
    SavedFingerprint,
    artifact_names,
    check_artifacts,
    read_saved,
    read_verified,
    record_artifacts,
    stale_code_files,
)
from nnscaler.parallel.fingerprint import check_graph, describe_differences
from nnscaler.parallel.savedir import CONSTANTS_FILE, FINGERPRINT_FILE, GRAPH_FILE

__all__ = ["decide", "start_generation", "finish_generation", "REGENERATE_HINT"]

_log = logging.getLogger(__name__)

REGENERATE_HINT = (
    "To regenerate the code pass reuse='moo' (regenerate when different) or reuse='override', "
    "or delete the directory"
)


def _raise_match(outdir: Path, what: str) -> None:
    raise ConfigError(f"reuse='match' but {what}. {REGENERATE_HINT} {outdir}")


def _file_problems(outdir: Path, saved: SavedFingerprint, cfg: ComputeConfig) -> list[str]:
    """Code files (what ranks import) must be there and match; other recorded files, where present."""
    record = saved.artifacts
    code = [f"gencode{r}.py" for r in range(cfg.runtime_ngpus)]
    code += [n for n in CODE_SUPPORT_FILES if n in (record or {}) or (outdir / n).exists()]
    rest = [n for n in artifact_names(outdir, cfg.runtime_ngpus) if n not in code and (outdir / n).exists()]
    return check_artifacts(outdir, record, code + rest)


def _saved_graph(outdir: Path, saved: SavedFingerprint, fp: dict[str, Any]) -> Graph:
    """graph.json, checked against the recorded sha256, for safe code fields and against the model."""
    if saved.problem:
        raise ConfigError(
            f"reuse='graph' but {saved.problem}, so {outdir / GRAPH_FILE} cannot be verified. "
            "Trace again with reuse='moo' (or 'override'), or delete the directory"
        )
    hint = "Trace the model again with reuse='moo' (or 'override'), or delete the directory"
    record = saved.artifacts if saved.data is not None else None
    if saved.data is not None and saved.data.get("format") == fp.get("format"):
        data = read_verified(outdir, GRAPH_FILE, record, "reuse='graph' refuses it. " + hint)
        if CONSTANTS_FILE in (record or {}):
            read_verified(outdir, CONSTANTS_FILE, record, "reuse='graph' refuses it. " + hint)
    else:  # no (or an older) fingerprint: check_graph says so
        data = (outdir / GRAPH_FILE).read_bytes()
    try:
        graph = graph_from_json(data.decode("utf-8"), where=str(outdir / GRAPH_FILE))
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"reuse='graph' but {outdir / GRAPH_FILE} cannot be loaded: {exc}") from exc
    check_graph(graph, saved.data, fp, str(outdir))
    return graph


def decide(
    outdir: Path, fp: dict[str, Any], reuse: ReuseType, cfg: ComputeConfig
) -> tuple[bool, Graph | None]:
    """(whether to generate code, a saved graph to generate it from instead of tracing)."""
    if reuse == ReuseType.OVERRIDE:
        return True, None
    saved = read_saved(outdir)
    if reuse == ReuseType.GRAPH:
        if not (outdir / GRAPH_FILE).exists():
            return True, None  # nothing saved yet: trace
        return True, _saved_graph(outdir, saved, fp)
    if saved.problem:
        if reuse == ReuseType.MATCH:
            _raise_match(outdir, saved.problem)
        return True, None
    if saved.data is None:
        return True, None  # no compile finished here
    try:
        diffs = describe_differences(saved.data, fp)
    except (TypeError, AttributeError, KeyError, ValueError, IndexError):  # valid JSON, not a fingerprint
        diffs = [f"{outdir / FINGERPRINT_FILE} is not a fingerprint nnscaler wrote"]
    if diffs and reuse == ReuseType.MATCH:
        more = f" (and {len(diffs) - 8} more)" if len(diffs) > 8 else ""
        raise ConfigError(
            f"reuse='match' but the code in {outdir} was generated for something else: "
            f"{'; '.join(diffs[:8])}{more}. To regenerate it pass reuse='moo' (regenerate when different) "
            "or reuse='override' (always); to keep both, pass another gen_savedir or instance_name"
        )
    if diffs:
        return True, None  # moo
    problems = _file_problems(outdir, saved, cfg)
    if problems and reuse == ReuseType.MATCH:
        _raise_match(
            outdir,
            f"the generated files in {outdir} are not those recorded in {FINGERPRINT_FILE}: {'; '.join(problems)}",
        )
    return bool(problems), None


_TEMPORARY = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp$")
"""write_atomic's temporary files (`.<name>.<mkstemp's 8 characters>.tmp`)."""


def start_generation(outdir: Path) -> None:
    """Remove the fingerprint first: until the new one is written, nothing claims to be complete.
    What an interrupted compile left (its temporary files; files without a fingerprint) is named in
    a warning, and the temporary files removed (the caller holds the directory's lock)."""
    found = []
    for temp in sorted(outdir.iterdir()):
        if _TEMPORARY.match(temp.name) and temp.is_file():
            temp.unlink(missing_ok=True)
            found.append(f"{temp.name} (removed)")
    if not (outdir / FINGERPRINT_FILE).exists() and any(outdir.glob("gencode*.py")):
        found.append(f"generated files without {FINGERPRINT_FILE} (never loaded)")
    if found:
        _log.warning(
            "%s holds what an interrupted compile left: %s; generating again", outdir, "; ".join(found)
        )
    (outdir / FINGERPRINT_FILE).unlink(missing_ok=True)


def finish_generation(outdir: Path, fp: dict[str, Any], cfg: ComputeConfig) -> None:
    """Drop code for ranks this config does not have (`gencode{rank}.py` only: other files are the
    user's), then write the fingerprint (last) with the sha256 of every file the compile wrote."""
    for stale in stale_code_files(outdir, cfg.runtime_ngpus):
        stale.unlink(missing_ok=True)
    names = artifact_names(outdir, cfg.runtime_ngpus)
    data = dict(fp, **{ARTIFACTS_KEY: record_artifacts(outdir, names)})
    write_atomic(outdir / FINGERPRINT_FILE, json.dumps(data, indent=1))
