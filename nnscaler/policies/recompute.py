"""Recompute groups: which modules' activations are recomputed in backward (pas_config recompute_modules)."""

from __future__ import annotations

from nnscaler.errors import PlanError
from nnscaler.graph.ir import Graph

__all__ = ["recompute_paths"]


def recompute_paths(graph: Graph, spec: str | list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """Module paths selected by `spec`: class names or path suffixes, comma-separated or a list.

    'ROOT' selects the whole model. Nested matches are dropped (the outermost module is recomputed).
    An entry that matches nothing is an error naming it and the module classes that exist.
    """
    if not spec:
        return ()
    entries = [e.strip() for e in (spec.split(",") if isinstance(spec, str) else spec) if e.strip()]
    if "ROOT" in entries:
        return ("",)
    paths = []
    for entry in entries:
        hits = [
            p
            for p, cls in graph.module_classes.items()
            if p and (cls == entry or p == entry or p.endswith("." + entry))
        ]
        if not hits:
            known = sorted(set(graph.module_classes.values()))
            raise PlanError(
                f"pas_config recompute_modules entry {entry!r} matches no module; module classes here: {known}"
            )
        paths.extend(hits)
    outer = [p for p in sorted(set(paths)) if not any(p != q and p.startswith(q + ".") for q in paths)]
    return tuple(sorted(outer, key=lambda p: [int(x) if x.isdigit() else x for x in p.split(".")]))
