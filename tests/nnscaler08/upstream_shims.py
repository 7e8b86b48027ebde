"""Stand-ins for the imports of nnScaler 0.8's policy files that this package does not provide (the
runner's only changes; each raises if a policy actually uses it):

- `nnscaler.autodist.apis.parallelize_graph` / `nnscaler.autodist.autodist_config.AutoDistConfig`
  (their pas_autodist, not run: autodist is our own `pas_policy='autodist'`);
- `nnscaler.graph.gener.rvd.intra.IntraAutoPlacer` (examples/utils.py's autoplace=True, unused);
- `more_itertools.divide`, when the package is not installed (pas_hybrid, swin's pas_1f1b);
- `examples.*` resolves to their examples/ beside ours (our repository has an examples package).
"""

from __future__ import annotations

import os
import sys
import types

UPSTREAM = os.environ.get("NNSCALER08_UPSTREAM", "/tmp/nns08_policies/upstream")


def _module(name: str, **attrs) -> types.ModuleType:
    module = sys.modules.get(name) or types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module
    return module


def _unavailable(what: str):
    def fail(*args, **kwargs):
        raise NotImplementedError(f"{what} is nnScaler 0.8 internals this runner does not provide")

    return fail


def _divide(n: int, iterable):
    """more_itertools.divide: n consecutive parts, sizes differing by at most one (larger first)."""
    items = list(iterable)
    q, r = divmod(len(items), n)
    out, start = [], 0
    for k in range(n):
        stop = start + q + (1 if k < r else 0)
        out.append(iter(items[start:stop]))
        start = stop
    return out


def install() -> None:
    _module("nnscaler.autodist", __path__=[])
    _module("nnscaler.autodist.apis", parallelize_graph=_unavailable("parallelize_graph"))
    _module("nnscaler.autodist.autodist_config", AutoDistConfig=_unavailable("AutoDistConfig"))
    for name in ("nnscaler.graph.gener", "nnscaler.graph.gener.rvd"):
        _module(name, __path__=[])
    placer = type("IntraAutoPlacer", (), {"auto_place": staticmethod(_unavailable("IntraAutoPlacer"))})
    _module("nnscaler.graph.gener.rvd.intra", IntraAutoPlacer=placer)
    try:
        import more_itertools  # noqa: F401
    except ImportError:
        _module("more_itertools", divide=_divide)
    import examples

    theirs = os.path.join(UPSTREAM, "examples")
    if theirs not in examples.__path__:
        examples.__path__.append(theirs)
