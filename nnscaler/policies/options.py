"""`ComputeConfig.pas_config` of the built-in policies: one typed dataclass per policy.

`parse_pas_config('pp', cfg.pas_config)` returns a `PpOptions`; an unknown key raises naming the
closest known key ("did you mean 'pipeline_nmicros'?"), a value of the wrong type raises naming
the field and the type it needs. Keys that start with `_` are accepted and ignored by every
policy (as in nnScaler: they only take part in deciding whether generated code can be reused).
A custom policy (a callable) reads `pas_config` itself: it is not validated.

Every field is listed in docs/policies.md (a test checks it).
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from nnscaler.errors import ConfigError, PlanError

__all__ = [
    "PasConfigError",
    "PolicyOptions",
    "DpOptions",
    "DataOptions",
    "ExpertParallelOptions",
    "TpOptions",
    "PipelineOptions",
    "PpOptions",
    "HybridOptions",
    "AutodistOptions",
    "POLICY_OPTIONS",
    "parse_pas_config",
    "leaf_module_options",
]


class PasConfigError(ConfigError, PlanError):
    """A bad `pas_config` key or value: a ConfigError (so a ValueError) and, as policies raised
    before, a PlanError."""


def _doc(text: str, **extra: Any) -> dict[str, Any]:
    return {"doc": text, **extra}


@dataclass(frozen=True)
class PolicyOptions:
    """Keys every built-in policy accepts."""

    recompute_modules: str | list[str] | None = field(
        default=None,
        metadata=_doc(
            "Modules whose activations are recomputed in backward (torch.utils.checkpoint): class names "
            "or module-path suffixes, comma-separated or a list; 'ROOT' is the whole model."
        ),
    )
    leaf_modules: str | list[str] | None = field(
        default=None,
        metadata=_doc(
            "Submodules that run as one opaque op each (eager PyTorch, replicated on every device of the plan, "
            "their parameters too): module paths (e.g. 'model.visual') or class names, comma-separated or a "
            "list. An entry that matches no submodule is an error. See docs/inputs.md."
        ),
    )
    auto_leaf_modules: bool = field(
        default=True,
        metadata=_doc(
            "When capture fails on data-dependent Python (a loop over `x.tolist()`) inside a submodule whose "
            "forward takes and returns tensors, run the innermost such submodule as an opaque op and retry, "
            "with a LeafModuleWarning. False: fail instead."
        ),
    )

    @classmethod
    def from_pas_config(cls, pas_config: Mapping[str, Any] | None, *, policy: str = "", strict: bool = True):
        """Build from a pas_config dict. `strict`: unknown keys raise (else they are ignored)."""
        pas_config = dict(pas_config or {})
        known = {f.name: f for f in dataclasses.fields(cls)}
        hints = get_type_hints(cls)
        policy = policy or cls.policy_name()
        values = {}
        for key, value in pas_config.items():
            if not isinstance(key, str):
                raise PasConfigError(f"pas_config keys must be strings, got {key!r}")
            if key.startswith("_"):
                continue
            if key not in known:
                if strict:
                    raise PasConfigError(_unknown_key_message(key, policy, sorted(known)))
                continue
            _check_value(key, value, hints[key], known[key].metadata, policy)
            values[key] = list(value) if isinstance(value, tuple) else value
        return cls(**values)

    @classmethod
    def policy_name(cls) -> str:
        return next((name for name, c in POLICY_OPTIONS.items() if c is cls), cls.__name__)


@dataclass(frozen=True)
class DpOptions(PolicyOptions):
    """Policy `dp`: the whole model on the single plan device (plan_ngpus == 1)."""


@dataclass(frozen=True)
class DataOptions(PolicyOptions):
    """Policy `data`: the batch dim split over the plan devices."""


@dataclass(frozen=True)
class ContextParallelOptions(PolicyOptions):
    """Keys that split the sequence of attention over devices (context parallelism)."""

    cp_size: int = field(
        default=1,
        metadata=_doc(
            "Devices the sequence is split over (context parallelism; docs/context_parallel.md). The plan "
            "devices (of each pipeline stage) form a cp_size x (rest) mesh, tensor parallelism on the rest.",
            min=1,
        ),
    )
    cp_kind: Literal["zigzag", "ring", "ulysses", "hybrid"] = field(
        default="zigzag",
        metadata=_doc(
            "How attention sees the whole sequence: 'zigzag' (ring of key/value blocks, balanced for causal "
            "masks), 'ring' (plain ring), 'ulysses' (all-to-all to heads), 'hybrid' (ulysses inside groups of "
            "cp_ulysses_size devices, ring across them)."
        ),
    )
    cp_ulysses_size: int | None = field(
        default=None,
        metadata=_doc(
            "Under cp_kind 'hybrid': devices of each Ulysses group (default: the largest power of two <= 8 "
            "that divides cp_size // 2).",
            min=1,
        ),
    )


@dataclass(frozen=True)
class ExpertParallelOptions(PolicyOptions):
    """Keys that split the experts of mixture-of-experts layers over devices (expert parallelism)."""

    ep_size: int = field(
        default=1,
        metadata=_doc(
            "Devices the experts are split over (expert parallelism; docs/moe.md). The plan devices (of each "
            "pipeline stage) form an ep_size x (rest) mesh: on the ep axis every op is split by the batch and "
            "each device holds experts / ep_size experts; tensor parallelism on the rest.",
            min=1,
        ),
    )


@dataclass(frozen=True)
class TpOptions(ContextParallelOptions, ExpertParallelOptions):
    """Policy `tp`: Megatron-style tensor parallelism over the plan devices (and the sequence over cp_size)."""


@dataclass(frozen=True)
class PipelineOptions(PolicyOptions):
    """Keys of the pipeline policies (`pp`, `hybrid`)."""

    pipeline_nmicros: int | None = field(
        default=None,
        metadata=_doc("Micro-batches per train_step (required for pipelines).", min=1),
    )
    pipeline_nstages: int | Literal["auto"] = field(
        default="auto",
        metadata=_doc(
            "Number of pipeline stages. 'auto': one per device group (two per device with 1f1b_interleaved, "
            "zbv and dualpipev).",
            min=1,
        ),
    )
    pipeline_scheduler: Literal["1f1b", "gpipe", "1f1b_interleaved", "zb_h1", "zbv", "dualpipev"] = field(
        default="1f1b", metadata=_doc("The schedule of forwards and backwards over the micro-batches.")
    )
    pipeline_pivots: str | list[str] | None = field(
        default=None,
        metadata=_doc(
            "Module class names where a stage may start, comma-separated or a list (default: the class of "
            "the repeated layers, the modules held in a ModuleList)."
        ),
    )
    pipeline_stages: list[str] | None = field(
        default=None,
        metadata=_doc(
            "Module paths where stages 1, 2, ... start (e.g. ['transformer.h.2']), instead of balancing "
            "the stages by estimated cost."
        ),
    )


@dataclass(frozen=True)
class PpOptions(PipelineOptions):
    """Policy `pp`: one pipeline stage per plan device (virtual stages with 1f1b_interleaved)."""


@dataclass(frozen=True)
class HybridOptions(PipelineOptions, ContextParallelOptions, ExpertParallelOptions):
    """Policy `hybrid`: pipeline stages over device groups, tensor parallelism (`tp`) inside each."""

    pp_size: int | None = field(
        default=None,
        metadata=_doc(
            "Number of device groups the stages run on (default: pipeline_nstages); each stage is split "
            "over plan_ngpus // pp_size devices.",
            min=1,
        ),
    )


@dataclass(frozen=True)
class AutodistOptions(PipelineOptions):
    """Policy `autodist`: the searched plan (docs/autodist.md). Pipeline keys constrain the search:
    `pipeline_nstages` 'auto' searches the stage count (pipelines only with use_end2end)."""

    pipeline_scheduler: Literal["1f1b", "gpipe", "1f1b_interleaved", "zb_h1", "zbv", "dualpipev", "auto"] = (
        field(
            default="auto",
            metadata=_doc(
                "The pipeline schedule. 'auto': every schedule the runtime runs (1F1B, zero-bubble ZB-H1, "
                "interleaved 1F1B, ZB-V, DualPipeV) is costed on the stage cut and the fastest that fits the "
                "memory limit is taken; the plan report says why. A name pins it."
            ),
        )
    )

    cluster: str | dict | None = field(
        default=None,
        metadata=_doc(
            "Cluster description: a YAML path, a shipped example ('h100x8', 'h100x64_ib', 'cpu_gloo') or the "
            "YAML's mapping; "
            "default: 'cpu_gloo' without CUDA, else one node of the current GPU kind."
        ),
    )
    mem_constraint: float | None = field(
        default=None, metadata=_doc("Memory per device in GB a plan may use (default: the device table's).")
    )
    zero_stage: int | None = field(
        default=None,
        metadata=_doc(
            "ZeRO stage the memory and time model assume (default: ComputeConfig's when use_zero, else 0).",
            min=0,
        ),
    )
    partition_constraints_path: str | None = field(
        default=None,
        metadata=_doc(
            "YAML list of partition constraints (name, parent_module, allowed_partition_dims, ...)."
        ),
    )
    partition_constraints: list[dict] | None = field(
        default=None, metadata=_doc("The same constraints given inline as a list of mappings.")
    )
    load_plan_path: str | None = field(
        default=None, metadata=_doc("Load this saved plan (JSON) instead of searching.")
    )
    save_plan_path: str | None = field(default=None, metadata=_doc("Save the chosen plan here (JSON)."))
    use_bf16: bool = field(default=False, metadata=_doc("Cost the model as if it ran in bf16."))
    use_fp16: bool = field(default=False, metadata=_doc("Cost the model as if it ran in fp16."))
    transient_mem_coef: float = field(
        default=2.0, metadata=_doc("Transient buffers as a multiple of the largest activation.")
    )
    profile_db_path: str | None = field(
        default=None,
        metadata=_doc(
            "Measured op times (JSON from nnscaler.policies.autodist.profiler) used instead of the analytic ones."
        ),
    )
    solver: Literal["auto", "cbc", "highs"] = field(
        default="auto",
        metadata=_doc("Integer-program solver ('auto': CBC; 'highs' needs highspy)."),
    )
    tp_mesh: str | list[int] = field(
        default="auto",
        metadata=_doc(
            "Mesh splits: a stage's tensor-parallel devices as a mesh [a, b] or [a, b, c] (the product = the "
            "degree; axis 0 takes a batch-like dim, each other axis a different dim), 'auto' (every a x b = "
            "the degree with a, b > 1, and from 8 devices a x b x c ones, up to 6 meshes, is solved and the "
            "cheapest taken; none under pipeline stages) or 'off' (1-D splits only)."
        ),
    )
    cp_size: int | Literal["auto"] = field(
        default="auto",
        metadata=_doc(
            "Context parallelism: devices of each stage the sequence is split over. 'auto': every divisor of "
            "a stage's devices leaving each at least 4,096 tokens is searched (1 = off; only for models with "
            "self-attention); an int pins it.",
            min=1,
        ),
    )
    cp_kind: Literal["auto", "zigzag", "ring", "ulysses", "hybrid"] = field(
        default="auto",
        metadata=_doc(
            "How context-parallel attention passes the sequence ('zigzag', 'ring', 'ulysses', 'hybrid'; as in "
            "policy tp); 'auto': each kind is costed and the cheapest taken."
        ),
    )
    cp_ulysses_size: int | None = field(
        default=None,
        metadata=_doc(
            "Under cp_kind 'hybrid': devices of each Ulysses group (default: every divisor of the cp degree "
            "strictly between 1 and it is costed).",
            min=2,
        ),
    )
    ep_size: int | Literal["auto"] = field(
        default="auto",
        metadata=_doc(
            "Expert parallelism: devices of each stage the experts of mixture-of-experts layers are split "
            "over (docs/moe.md). 'auto': every divisor of a stage's devices that divides every layer's "
            "experts is searched (1 = off; only for models with a recognised MoE layer); an int pins it.",
            min=1,
        ),
    )
    update_freq: int | list[int] | None = field(
        default=None,
        metadata=_doc(
            "nnScaler 0.8's name for the micro-batches per step (a list: its first value): taken as "
            "pipeline_nmicros when that is not given.",
            min=1,
        ),
    )
    task_name: str | None = field(
        default=None,
        metadata=_doc(
            "nnScaler 0.8's label of its plan files: accepted and ignored with a warning (name the plan "
            "file with save_plan_path)."
        ),
    )

    def __post_init__(self) -> None:
        """nnScaler 0.8's keys: `update_freq` becomes `pipeline_nmicros`; `task_name` is ignored, warned."""
        if self.task_name is not None:
            warnings.warn(
                f"pas_config['task_name']={self.task_name!r} is ignored by autodist here (nnScaler 0.8 names "
                "its plan files with it; use save_plan_path)",
                stacklevel=4,
            )
        freq = self.update_freq[0] if isinstance(self.update_freq, list) else self.update_freq
        if freq is not None and self.pipeline_nmicros is None:
            object.__setattr__(self, "pipeline_nmicros", freq)


POLICY_OPTIONS: dict[str, type[PolicyOptions]] = {
    "dp": DpOptions,
    "data": DataOptions,
    "tp": TpOptions,
    "pp": PpOptions,
    "hybrid": HybridOptions,
    "autodist": AutodistOptions,
}
"""The options dataclass of every built-in policy, by name."""

_NOT_HERE = {
    "seed": "the tp policy here is deterministic (it recognises Megatron patterns, it does not sample)",
}
"""nnScaler keys that have no meaning here, and why."""


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if tp is type(None):
        return "None"
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(t) for t in get_args(tp))
    if origin is Literal:
        return " or ".join(repr(a) for a in get_args(tp))
    if origin in (list, tuple):
        return f"a list of {_type_name(get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))


def _matches(value: Any, tp: Any) -> bool:
    origin = get_origin(tp)
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if origin in (Union, types.UnionType):
        return any(_matches(value, t) for t in get_args(tp))
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in get_args(tp))
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(_matches(v, get_args(tp)[0]) for v in value)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, tp)


def _check_value(key: str, value: Any, tp: Any, meta: Mapping[str, Any], policy: str) -> None:
    if not _matches(value, tp):
        raise PasConfigError(
            f"pas_config[{key!r}] of policy {policy!r} must be {_type_name(tp)}, got {value!r} "
            f"({type(value).__name__})"
        )
    low = meta.get("min")
    if low is not None and isinstance(value, int) and not isinstance(value, bool) and value < low:
        raise PasConfigError(f"pas_config[{key!r}] of policy {policy!r} must be >= {low}, got {value!r}")


def _unknown_key_message(key: str, policy: str, known: list[str]) -> str:
    msg = f"pas_config key {key!r} is not an option of policy {policy!r}"
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        msg += f": did you mean {close[0]!r}?"
    elif key in _NOT_HERE:
        msg += f": {_NOT_HERE[key]}"
    else:
        owners = [
            name for name, c in POLICY_OPTIONS.items() if key in {f.name for f in dataclasses.fields(c)}
        ]
        if owners:
            msg += f": it is an option of {', '.join(repr(o) for o in owners)}"
    end = "" if msg.endswith("?") else "."  # "did you mean 'x'?" ends the sentence already
    return (
        f"{msg}{end} Options of {policy!r}: {known} (docs/policies.md); keys starting with '_' are "
        "accepted and ignored"
    )


def leaf_module_options(pas_config: Mapping[str, Any] | None) -> tuple[list[str], bool]:
    """(`leaf_modules` as a list, `auto_leaf_modules`) of any pas_config, a custom policy's too: what
    capture reads (graph/capture/leaf_modules.py); a value of the wrong type raises naming the key."""
    pas_config = dict(pas_config or {})
    keys = ("leaf_modules", "auto_leaf_modules")
    opts = PolicyOptions.from_pas_config({k: pas_config[k] for k in keys if k in pas_config}, policy="any")
    names = opts.leaf_modules or []
    if isinstance(names, str):
        names = names.split(",")
    return [n.strip() for n in names if n.strip()], opts.auto_leaf_modules


def parse_pas_config(
    policy: str, pas_config: Mapping[str, Any] | None, *, strict: bool = True
) -> PolicyOptions:
    """The typed options of built-in policy `policy` from `pas_config` (see the module docstring)."""
    if policy not in POLICY_OPTIONS:
        raise PasConfigError(f"no built-in policy {policy!r}: use one of {sorted(POLICY_OPTIONS)}")
    return POLICY_OPTIONS[policy].from_pas_config(pas_config, policy=policy, strict=strict)
