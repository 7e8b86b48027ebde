"""`nnscaler.profiler`: the public name of autodist's measured op costs.

    python -m nnscaler.profiler --model tests.zoo.build_gpt --ways 1,2 --out ops.json

or from Python: `profile_module(model, dummy_inputs, ways=(1, 2)).save("ops.json")`. The
implementation is `nnscaler.policies.autodist.profiler`; the command is `nnscaler.cli.profile`.
"""

from __future__ import annotations

from nnscaler.policies.autodist.profiler import (
    ProfileDB,
    fit_link,
    profile_graph,
    profile_link,
    profile_module,
)

__all__ = ["ProfileDB", "profile_module", "profile_graph", "profile_link", "fit_link"]

if __name__ == "__main__":
    from nnscaler.cli.profile import main

    main()
