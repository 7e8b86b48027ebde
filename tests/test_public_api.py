"""The public surface: nnScaler 0.8's names and parameters are all here (users switch without edits),
and every public signature is recorded in tests/golden/public_api.txt, so a change to one is a
deliberate edit of that file (as torchtitan guards its CLI), never an accident.

Regenerate the record after an intended change: `python -m tests.test_public_api`.
"""

from __future__ import annotations

import inspect
import os
import sys

import nnscaler
import nnscaler.parallel
import nnscaler.utils
from nnscaler import ComputeConfig, ParallelModule

GOLDEN = os.path.join(os.path.dirname(__file__), "golden", "public_api.txt")

NNSCALER_0_8 = {
    # name -> the parameters nnScaler 0.8 users pass, in order (positional first, then keyword-only)
    "parallelize": [
        "module_or_module_class",
        "dummy_forward_args",
        "pas_policy",
        "compute_config",
        "gen_savedir",
        "reuse",
        "instance_name",
        "load_module",
        "module_dtype",
        "module_fn",
        "init_module_params",
        "broadcast_strategy",
    ],
    "build_optimizer": ["module", "optimizer_fn", "compute_config"],
    "merge_state_dicts": ["module_state_dicts", "optimizer_state_dicts"],
    "load_merged_state_dict": ["module", "module_state_dict", "optimizer", "optimizer_state_dict", "device"],
    "deduped_state_dict": ["module", "optimizer"],
    "load_deduped_state_dict": ["module", "module_state_dict", "optimizer", "optimizer_state_dict", "device"],
    "load_sharded_state_dict": ["module", "module_state_dict", "optimizer", "optimizer_state_dict", "device"],
    "broadcast_weights": ["module", "stride_size"],
    "sync_grad_when": ["cond"],
    "register_op": ["annotation", "name", "code_impl_pattern", "emit_fn", "transform_rules", "input_gen_fn"],
    "anchor": ["name"],
    "constant_folding": ["constant_folding"],
    "no_constant_folding": [],
    "fold_constant": ["a"],
    "init": [],
    "uninit": [],
}
NNSCALER_0_8_UTILS = {  # nnscaler.utils: what nnScaler 0.8's examples call
    "set_default_logger_level": ["level"],
    "print_each_rank": ["msg", "rank_only", "logger"],
}
NNSCALER_0_8_CLASSES = ["ParallelModule", "ComputeConfig", "ReuseType", "BroadcastGenFilesStrategy"]
PARALLEL_MODULE_MEMBERS = [
    "forward",
    "train_step",
    "infer_step",
    "sync_grad",
    "clip_gnorm",
    "zero_grad",
    "parameters_for_optimizer",
    "parameters_for_broadcast",
    "parameters_for_calc_gnorm",
    "gather_params",
    "reducers",
    "fullmap",
    "dist_param_map",
    "compute_config",
    "load_merged_state_dict",
    "state_dict",
    "load_state_dict",
    "get_checkpoint",
    "save_checkpoint",
    "merge_checkpoints",
    "rank",
    "use_scheduler",
    "nmicros_per_scheduler_step",
    "non_presistent_buffers_inited",  # nnScaler's spelling (non_persistent_buffers_inited works too)
    "mark_non_persistent_buffers_inited",
]
COMPUTE_CONFIG_FIELDS = [  # nnScaler's, in its order (tests construct ComputeConfig(2, 4))
    "plan_ngpus",
    "runtime_ngpus",
    "constant_folding",
    "trace_strategy",
    "use_zero",
    "zero_ngroups",
    "zero_use_reduce_scatter",
    "inference_only",
    "use_end2end",
    "use_async_reducer",
    "reducer_bucket_cap_mb",
    "pas_config",
    "user_config",
]
COMPUTE_CONFIG_MEMBERS = [
    "gpu_config",
    "graph_config",
    "module_dedup_group_size",
    "optimizer_dedup_group_size",
    "max_bucket_size_bytes",
    "get_sync_group",
    "safe_dump_to_file",
    "safe_load_from_file",
    "safe_equals",
]


def test_nnscaler_names_and_parameters() -> None:
    for name, params in NNSCALER_0_8.items():
        assert name in nnscaler.__all__, f"nnscaler.{name} is missing"
        got = list(inspect.signature(getattr(nnscaler, name)).parameters)
        assert got[: len(params)] == params or all(p in got for p in params), (name, got)
        positional = [
            p.name
            for p in inspect.signature(getattr(nnscaler, name)).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        # what nnScaler accepts positionally is accepted positionally here, in the same order
        want = [p for p in params if p in positional]
        assert positional[: len(want)] == want, (
            f"{name}: positional parameters {positional}, nnScaler {params}"
        )
    for name in NNSCALER_0_8_CLASSES:
        assert name in nnscaler.__all__
    module = ParallelModule(rank=0, world_size=1, plan_ngpus=1, groups={}, all_groups=[])
    for member in PARALLEL_MODULE_MEMBERS:
        assert hasattr(module, member), f"ParallelModule.{member} is missing"
    fields = list(ComputeConfig.__dataclass_fields__)
    assert fields[: len(COMPUTE_CONFIG_FIELDS)] == COMPUTE_CONFIG_FIELDS
    for member in COMPUTE_CONFIG_MEMBERS:
        assert hasattr(ComputeConfig, member), f"ComputeConfig.{member} is missing"


def test_nnscaler_utils_has_the_0_8_helpers() -> None:
    for name, params in NNSCALER_0_8_UTILS.items():
        assert name in nnscaler.utils.__all__, f"nnscaler.utils.{name} is missing"
        assert list(inspect.signature(getattr(nnscaler.utils, name)).parameters) == params, name


def test_nnscaler_parallel_has_the_0_8_names() -> None:
    # nnScaler 0.8's docs and tests write `from nnscaler.parallel import parallelize, ComputeConfig, ...`
    names = [*NNSCALER_0_8_CLASSES, *(n for n in NNSCALER_0_8 if n in nnscaler.parallel.NNSCALER_08_NAMES)]
    for name in names:
        assert name in nnscaler.parallel.__all__, f"nnscaler.parallel.{name} is missing"
        assert getattr(nnscaler.parallel, name) is getattr(nnscaler, name), name
    wanted = "parallelize build_optimizer merge_state_dicts load_merged_state_dict broadcast_weights"
    more = " sync_grad_when deduped_state_dict load_deduped_state_dict load_sharded_state_dict"
    for name in (wanted + more).split():
        assert name in nnscaler.parallel.NNSCALER_08_NAMES, name


def _describe(obj: object) -> str:
    try:
        return str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "<no signature>"


def public_signatures() -> str:
    """One line per public name (and per public member of the public classes)."""
    lines = []
    for name in sorted(nnscaler.__all__):
        obj = getattr(nnscaler, name)
        if name == "__version__":
            continue
        lines.append(f"nnscaler.{name}{_describe(obj)}")
        if inspect.isclass(obj) and obj.__module__.startswith("nnscaler"):
            for member, value in sorted(vars(obj).items()):
                if member.startswith("_"):
                    continue
                if callable(value) or isinstance(value, (property, classmethod, staticmethod)):
                    target = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
                    sig = "<property>" if isinstance(value, property) else _describe(target)
                    lines.append(f"nnscaler.{name}.{member}{sig}")
    for name in sorted(nnscaler.parallel.__all__):  # nnScaler 0.8's import path, and the driver's own names
        obj = getattr(nnscaler.parallel, name)
        same = getattr(nnscaler, name, None) is obj
        lines.append(f"nnscaler.parallel.{name}" + (" = nnscaler." + name if same else _describe(obj)))
    for name in sorted(nnscaler.utils.__all__):  # nnScaler 0.8's helpers for scripts
        lines.append(f"nnscaler.utils.{name}{_describe(getattr(nnscaler.utils, name))}")
    lines += _policy_api_08_lines()
    fields = ", ".join(f"{f.name}: {f.type}" for f in ComputeConfig.__dataclass_fields__.values())
    lines.append(f"nnscaler.ComputeConfig fields ({fields})")
    return "\n".join(lines) + "\n"


POLICY_API_08_MODULES = [  # nnScaler 0.8's policy API: the import paths its policies and examples use
    "nnscaler.graph",
    "nnscaler.graph.graph",
    "nnscaler.graph.segment",
    "nnscaler.graph.function.anchor",
    "nnscaler.graph.function.dimops",
    "nnscaler.graph.schedule.predefined",
    "nnscaler.graph.parser.register",
    "nnscaler.ir",
    "nnscaler.ir.operator",
    "nnscaler.ir.cten",
    "nnscaler.ir.tensor",
]


def _policy_api_08_lines() -> list[str]:
    """Each module's names (where they live) and, once, each class's public members."""
    import importlib

    lines, seen = [], set()
    for path in POLICY_API_08_MODULES:
        module = importlib.import_module(path)
        for name in sorted(getattr(module, "__all__", ("IRGraph", "IRSegment"))):
            obj = getattr(module, name)
            lines.append(f"{path}.{name} = {obj.__module__}.{obj.__qualname__}")
            if not inspect.isclass(obj) or obj in seen:
                continue
            seen.add(obj)
            for member, value in sorted(vars(obj).items()):
                if member.startswith("_") or not (
                    callable(value) or isinstance(value, (property, staticmethod))
                ):
                    continue
                target = value.__func__ if isinstance(value, staticmethod) else value
                sig = "<property>" if isinstance(value, property) else _describe(target)
                lines.append(f"  {obj.__qualname__}.{member}{sig}")
    return lines


def test_nnscaler_08_policy_api_names_import() -> None:
    # what nnScaler 0.8's policies.py, swin's policy gallery and examples/utils.py import
    from nnscaler.graph import IRGraph  # noqa: F401
    from nnscaler.graph.function.anchor import IRGraphAnchor  # noqa: F401
    from nnscaler.graph.function.dimops import DimopSplit, IRDimops, TransformRule  # noqa: F401
    from nnscaler.graph.parser.register import register_op
    from nnscaler.graph.schedule.predefined import PredefinedSched  # noqa: F401
    from nnscaler.graph.segment import IRSegment  # noqa: F401
    from nnscaler.ir import IRCell, IRFullTensor, IRSubTensor, IRTensor  # noqa: F401
    from nnscaler.ir.cten import IRCell as Cell
    from nnscaler.ir.operator import IRBpOperation, IRDataOperation, IRFwOperation  # noqa: F401
    from nnscaler.ir.tensor import IRFullTensor as Full

    assert register_op is nnscaler.register_op and Cell is IRCell and Full is IRFullTensor


def test_public_signatures_are_recorded() -> None:
    with open(GOLDEN) as f:
        recorded = f.read()
    now = public_signatures()
    if now != recorded:
        import difflib

        diff = "".join(
            difflib.unified_diff(recorded.splitlines(True), now.splitlines(True), "recorded", "now")
        )
        raise AssertionError(
            "the public API changed; if intended, regenerate tests/golden/public_api.txt with "
            f"`python -m tests.test_public_api` and say so in the change:\n{diff}"
        )


if __name__ == "__main__":
    with open(GOLDEN, "w") as f:
        f.write(public_signatures())
    print(f"wrote {GOLDEN}", file=sys.stderr)
