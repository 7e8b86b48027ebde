"""Field checks of `ComputeConfig` (issue 41: every setting either applies or is refused).

`FIELD_TYPES` says, for every field, the values it takes; `check_types` refuses another type naming the
field. `check_applies` refuses a non-default value that the rest of the config makes meaningless (a ZeRO
knob without `use_zero`, a gradient knob on a forward-only module, a Zeno knob under another
aggregation), naming the field and the fix. Ranges and the older cross-field rules stay in
`ComputeConfig.__post_init__`. This module reads the config as `Any`: config.py imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nnscaler.errors import ConfigError

__all__ = ["FIELD_TYPES", "TRACE_STRATEGIES", "check_types", "check_applies"]

TRACE_STRATEGIES = ("cpu", "cuda", "meta", "cuda_run_cpu_offload", "reuse_cache")
"""nnScaler 0.8's values of `trace_strategy` (accepted for compatibility: tracing here is on fake tensors)."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_bool(v: Any) -> bool:
    return isinstance(v, bool)


def _or_none(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


FIELD_TYPES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "plan_ngpus": (_is_int, "an int"),
    "runtime_ngpus": (_or_none(_is_int), "an int or None"),
    "constant_folding": (_is_bool, "True or False"),
    "trace_strategy": (lambda v: v in TRACE_STRATEGIES, f"one of {TRACE_STRATEGIES}"),
    "use_zero": (_is_bool, "True or False"),
    "zero_ngroups": (_is_int, "an int"),
    "zero_use_reduce_scatter": (_is_bool, "True or False"),
    "inference_only": (_is_bool, "True or False"),
    "use_end2end": (_is_bool, "True or False"),
    "use_async_reducer": (_is_bool, "True or False"),
    "reducer_bucket_cap_mb": (_or_none(_is_number), "a number of MB or None"),
    "pas_config": (lambda v: isinstance(v, dict), "a dict (the policy's options)"),
    "user_config": (lambda v: isinstance(v, dict), "a dict"),
    "zero_stage": (_is_int, "1, 2 or 3"),
    "dp_grad_reduction": (lambda v: isinstance(v, str), "'mean' or 'sum'"),
    "reducer_bucket_autotune": (_is_bool, "True or False"),
    "hierarchical_allreduce": (_or_none(_is_bool), "True, False or None"),
    "zero3_prefetch_blocks": (_is_int, "an int >= 0"),
    "reduce_grads_in_fp32": (_is_bool, "True or False"),
    "grad_aggregation": (lambda v: isinstance(v, str), "a string"),
    "byzantine_b": (_is_int, "an int >= 0"),
    "zeno_gamma": (_is_number, "a number > 0"),
    "zeno_rho": (_is_number, "a number >= 0"),
    "torch_compile": (
        lambda v: isinstance(v, (bool, dict)),
        "True, False or a dict of torch.compile options",
    ),
    "trace_time_budget_s": (_or_none(_is_number), "a number of seconds or None"),
}
"""Every ComputeConfig field: (accepts the value, what it must be). A new field needs an entry (checked)."""


def check_types(cfg: Any, names: list[str]) -> None:
    """Refuse a value of the wrong type; `names` are the dataclass's fields (each must have an entry)."""
    missing = sorted(set(names) - set(FIELD_TYPES))
    if missing:
        raise ConfigError(
            f"nnscaler.config_checks.FIELD_TYPES has no entry for ComputeConfig field(s) {missing}"
        )
    for name in names:
        ok, what = FIELD_TYPES[name]
        value = getattr(cfg, name)
        if not ok(value):
            raise ConfigError(f"ComputeConfig.{name} must be {what}, got {value!r} ({type(value).__name__})")


_GRAD_FIELDS = {
    "use_async_reducer": True,
    "reducer_bucket_cap_mb": None,
    "reducer_bucket_autotune": False,
    "reduce_grads_in_fp32": False,
    "hierarchical_allreduce": None,
    "dp_grad_reduction": "mean",
    "grad_aggregation": "mean",
}
"""Gradient settings with the value that means "not set": a forward-only module has no gradients."""


def _requirements(cfg: Any) -> list[tuple[str, Any, bool, str]]:
    """(field, its "not set" value, whether a set value applies, the fix) for every conditional field."""
    zero3 = cfg.use_zero and cfg.zero_stage == 3
    rules = [
        ("zero_ngroups", 1, cfg.use_zero, "set use_zero=True, or leave zero_ngroups at 1"),
        ("zero_use_reduce_scatter", False, cfg.use_zero, "set use_zero=True, or leave it False"),
        ("zero_stage", 1, cfg.use_zero, "set use_zero=True to shard, or leave zero_stage at 1"),
        (
            "zero3_prefetch_blocks",
            1,
            zero3,
            "it is read only under ZeRO stage 3: set use_zero=True and zero_stage=3, or leave it at 1",
        ),
        (
            "hierarchical_allreduce",
            None,
            cfg.hierarchical_allreduce is False or not cfg.use_zero,
            "ZeRO reduces over its own groups: leave hierarchical_allreduce None, or set use_zero=False",
        ),
        (
            "reducer_bucket_cap_mb",
            None,
            not cfg.reducer_bucket_autotune,
            "reducer_bucket_autotune=True picks the bucket size itself: drop one of the two",
        ),
        (
            "byzantine_b",
            1,
            cfg.grad_aggregation != "mean" or cfg.byzantine_b == 0,
            "it is read only by the robust modes: set grad_aggregation to 'median', 'trimmed_mean' or 'zeno'",
        ),
        ("zeno_gamma", 0.01, cfg.grad_aggregation == "zeno", "it is read only by grad_aggregation='zeno'"),
        ("zeno_rho", 1e-4, cfg.grad_aggregation == "zeno", "it is read only by grad_aggregation='zeno'"),
    ]
    for name, unset in _GRAD_FIELDS.items():
        fix = "a forward-only module has no gradients: drop it or set inference_only=False"
        rules.append((name, unset, not cfg.inference_only, fix))
    return rules


def check_applies(cfg: Any) -> None:
    """Refuse a field set (not at its "not set" value) where the rest of the config leaves it unread."""
    for name, unset, applies, fix in _requirements(cfg):
        value = getattr(cfg, name)
        if applies or value == unset:
            continue
        context = _context(cfg, name)
        raise ConfigError(f"ComputeConfig.{name}={value!r} has no effect with {context}: {fix}")


def _context(cfg: Any, name: str) -> str:
    """The settings that make field `name` unread (for the message)."""
    if name in _GRAD_FIELDS and cfg.inference_only:
        return "inference_only=True"
    if name == "zero3_prefetch_blocks":
        return f"use_zero={cfg.use_zero}, zero_stage={cfg.zero_stage}"
    if name.startswith("zero"):
        return "use_zero=False"
    if name == "hierarchical_allreduce":
        return "use_zero=True"
    if name == "reducer_bucket_cap_mb":
        return "reducer_bucket_autotune=True"
    return f"grad_aggregation={cfg.grad_aggregation!r}"
