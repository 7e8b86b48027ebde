"""Stand-ins, at interpreter start, for nnScaler 0.8 internals that its compile_hf.py and swin's
train.py import but this package does not provide (put on PYTHONPATH by run.py for those rows only;
each is listed in the table, and each raises if actually called where noted):

- tests/nnscaler08/upstream_shims.py (nnscaler.graph.gener.rvd.intra for examples/utils.py, ...);
- nnscaler.profiler.timer (CudaTimer, print_each_rank) and nnscaler.profiler.memory (memory_summary:
  prints nothing on CPU), imported by swin's train.py; nnscaler.runtime.function.anchor (our
  nnscaler.anchor), called by swin's model;
- nnscaler.graph.parser.converter.to_fx_graph and nnscaler.runtime.utils.microbatches, imported by
  compile_interface.py for its trace path (off by default): they raise if called.
"""

from __future__ import annotations

import sys
import types


def _module(name: str, **attrs) -> None:
    module = sys.modules.get(name) or types.ModuleType(name)
    module.__dict__.update(attrs)
    sys.modules[name] = module


def _unavailable(what: str):
    def fail(*args, **kwargs):
        raise NotImplementedError(f"{what}: nnScaler 0.8 internals the examples runner does not provide")

    return fail


def _install() -> None:
    import upstream_shims

    from nnscaler.utils import print_each_rank

    upstream_shims.install()

    class CudaTimer:  # swin imports it, never times with it
        def __init__(self, *args, **kwargs):
            pass

        def start(self, *args, **kwargs):
            pass

        def stop(self, *args, **kwargs):
            pass

    _module("nnscaler.profiler.timer", CudaTimer=CudaTimer, print_each_rank=print_each_rank)
    _module("nnscaler.profiler.memory", memory_summary=lambda *a, **k: None)
    import nnscaler.runtime

    if not hasattr(nnscaler.runtime, "function"):  # swin's model calls nnscaler.runtime.function.anchor
        nnscaler.runtime.function = types.SimpleNamespace(anchor=nnscaler.anchor)
    _module("nnscaler.graph.parser.converter", to_fx_graph=_unavailable("to_fx_graph"))
    _module("nnscaler.runtime.utils", microbatches=_unavailable("microbatches"))


_install()
