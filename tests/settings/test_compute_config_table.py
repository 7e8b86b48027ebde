"""Every ComputeConfig field either applies or is refused (issue 41).

One table, one row per (field, value): a refused row names the ConfigError it must raise (a regex that
names the field); an accepted row says why the value is valid. Every field needs a refused row, and a
field of the dataclass without a row fails the test. All checks run at construction: no processes.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import pytest

from nnscaler import ComputeConfig
from nnscaler.errors import ConfigError

BASE: dict[str, Any] = {"plan_ngpus": 2, "runtime_ngpus": 4}
"""Two data-parallel replicas of a 2-device plan, unless a row says otherwise."""
ZERO = {"use_zero": True}
INFER = {"inference_only": True}


@dataclass(frozen=True)
class Row:
    field: str
    value: Any
    refused: str = ""
    """Regex of the ConfigError's message ("" = accepted)."""
    why: str = ""
    """Accepted: why the value is valid."""
    also: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Other fields of the config the value is tried with."""
    env: dict[str, str | None] = field(default_factory=dict)


def R(name: str, value: Any, refused: str, **also: Any) -> Row:
    return Row(name, value, refused=refused, also=also)


def A(name: str, value: Any, why: str, **also: Any) -> Row:
    return Row(name, value, why=why, also=also)


TYPE = "must be"  # the type refusals: "ComputeConfig.<field> must be <what>, got <value> (<type>)"
UNREAD = "has no effect with"  # a value the rest of the config leaves unread

TABLE: list[Row] = [
    R("plan_ngpus", 0, "plan_ngpus must be a positive int"),
    R("plan_ngpus", "2", "plan_ngpus must be an int"),
    R("plan_ngpus", True, "plan_ngpus must be an int, got True"),
    R("plan_ngpus", 3, r"runtime_ngpus \(4\) must be a multiple of plan_ngpus \(3\)"),
    A("plan_ngpus", 4, "one replica of a 4-device plan"),
    R("runtime_ngpus", 0, "runtime_ngpus must be a positive int"),
    R("runtime_ngpus", 4.0, "runtime_ngpus must be an int or None"),
    R("runtime_ngpus", 3, r"runtime_ngpus \(3\) must be a multiple of plan_ngpus"),
    Row(
        "runtime_ngpus",
        None,
        refused=r"runtime_ngpus is None and \$WORLD_SIZE is not set",
        env={"WORLD_SIZE": None},
    ),
    Row("runtime_ngpus", None, why="taken from $WORLD_SIZE (torchrun)", env={"WORLD_SIZE": "2"}),
    R("constant_folding", "yes", f"constant_folding {TYPE} True or False"),
    A("constant_folding", True, "writes traced sizes into the generated code, with any policy"),
    R("trace_strategy", "gpu", "trace_strategy must be one of .*'cuda_run_cpu_offload'"),
    R("trace_strategy", None, "trace_strategy must be one of"),
    A(
        "trace_strategy",
        "cpu",
        "nnScaler 0.8's value, kept for compatibility: tracing is on fake tensors (documented)",
    ),
    R("use_zero", "true", f"use_zero {TYPE} True or False"),
    R("use_zero", 1, f"use_zero {TYPE} True or False"),
    A("use_zero", True, "shards optimizer state over the 2 replicas"),
    A("use_zero", True, "one replica: a script debugged on one device runs unchanged", runtime_ngpus=2),
    R("zero_ngroups", 0, "zero_ngroups must be >= 1", **ZERO),
    R("zero_ngroups", "2", f"zero_ngroups {TYPE} an int"),
    R("zero_ngroups", 3, r"zero_ngroups \(3\) must divide the number of data-parallel replicas", **ZERO),
    R("zero_ngroups", 2, f"zero_ngroups=2 {UNREAD} use_zero=False: set use_zero=True"),
    A("zero_ngroups", 2, "two ZeRO groups of one replica each", **ZERO),
    R("zero_use_reduce_scatter", "no", f"zero_use_reduce_scatter {TYPE} True or False"),
    R("zero_use_reduce_scatter", True, f"zero_use_reduce_scatter=True {UNREAD} use_zero=False"),
    A("zero_use_reduce_scatter", True, "ZeRO reduces with reduce-scatter", **ZERO),
    R("inference_only", "x", f"inference_only {TYPE} True or False"),
    R("inference_only", True, r"inference_only=True\) has no gradients .*set use_zero=False", **ZERO),
    A("inference_only", True, "a forward-only module"),
    R("use_end2end", "x", f"use_end2end {TYPE} True or False"),
    A("use_end2end", True, "train_step / infer_step"),
    R("use_async_reducer", None, f"use_async_reducer {TYPE} True or False"),
    R("use_async_reducer", False, f"use_async_reducer=False {UNREAD} inference_only=True", **INFER),
    A("use_async_reducer", False, "buckets reduced after backward"),
    R("reducer_bucket_cap_mb", -1, "reducer_bucket_cap_mb must be >= 0"),
    R("reducer_bucket_cap_mb", "25", f"reducer_bucket_cap_mb {TYPE} a number of MB or None"),
    R(
        "reducer_bucket_cap_mb",
        5,
        f"reducer_bucket_cap_mb=5 {UNREAD} reducer_bucket_autotune=True",
        reducer_bucket_autotune=True,
    ),
    R("reducer_bucket_cap_mb", 5, f"reducer_bucket_cap_mb=5 {UNREAD} inference_only=True", **INFER),
    A("reducer_bucket_cap_mb", 0.5, "half-MB buckets"),
    R("pas_config", [("cp_size", 2)], f"pas_config {TYPE} a dict"),
    R("pas_config", None, f"pas_config {TYPE} a dict"),
    A("pas_config", {"_note": 1}, "keys are the policy's, checked when it plans (test_pas_config_table.py)"),
    R("user_config", "x", f"user_config {TYPE} a dict"),
    A("user_config", {"data": "v2"}, "only decides whether generated code is reused (documented)"),
    R("zero_stage", 4, "zero_stage must be 1 .*, 2 .* or 3", **ZERO),
    R("zero_stage", "2", f"zero_stage {TYPE} 1, 2 or 3"),
    R("zero_stage", 2, f"zero_stage=2 {UNREAD} use_zero=False: set use_zero=True"),
    A("zero_stage", 3, "ZeRO-3", **ZERO),
    R("dp_grad_reduction", "avg", "dp_grad_reduction must be 'mean' or 'sum'"),
    R("dp_grad_reduction", None, f"dp_grad_reduction {TYPE} 'mean' or 'sum'"),
    R("dp_grad_reduction", "sum", f"dp_grad_reduction='sum' {UNREAD} inference_only=True", **INFER),
    A("dp_grad_reduction", "sum", "nnScaler 0.8's summed gradients"),
    R("reducer_bucket_autotune", "y", f"reducer_bucket_autotune {TYPE} True or False"),
    R(
        "reducer_bucket_autotune",
        True,
        r"reducer_bucket_autotune=True\) cannot be used with use_zero=True",
        **ZERO,
    ),
    R("reducer_bucket_autotune", True, f"reducer_bucket_autotune=True {UNREAD} inference_only=True", **INFER),
    A("reducer_bucket_autotune", True, "tries bucket sizes over the first steps"),
    R("hierarchical_allreduce", "y", f"hierarchical_allreduce {TYPE} True, False or None"),
    R("hierarchical_allreduce", True, f"hierarchical_allreduce=True {UNREAD} use_zero=True", **ZERO),
    R("hierarchical_allreduce", True, f"hierarchical_allreduce=True {UNREAD} inference_only=True", **INFER),
    A("hierarchical_allreduce", False, "'never': what ZeRO does anyway", **ZERO),
    A(
        "hierarchical_allreduce",
        True,
        "whenever the replicas span nodes (on one node: the flat ring, documented)",
    ),
    R("zero3_prefetch_blocks", -1, "zero3_prefetch_blocks must be an int >= 0", use_zero=True, zero_stage=3),
    R("zero3_prefetch_blocks", 1.5, f"zero3_prefetch_blocks {TYPE} an int >= 0"),
    R("zero3_prefetch_blocks", 2, f"zero3_prefetch_blocks=2 {UNREAD} use_zero=True, zero_stage=1", **ZERO),
    A("zero3_prefetch_blocks", 0, "ZeRO-3 without prefetch", use_zero=True, zero_stage=3),
    R("reduce_grads_in_fp32", "y", f"reduce_grads_in_fp32 {TYPE} True or False"),
    R("reduce_grads_in_fp32", True, f"reduce_grads_in_fp32=True {UNREAD} inference_only=True", **INFER),
    A("reduce_grads_in_fp32", True, "fp32 gradient buckets"),
    R("grad_aggregation", "max", "grad_aggregation must be one of"),
    R("grad_aggregation", 3, f"grad_aggregation {TYPE} a string"),
    R(
        "grad_aggregation",
        "median",
        r"needs at least 3 data-parallel replicas .*lower byzantine_b or add replicas",
    ),
    R("grad_aggregation", "zeno", "not supported with ZeRO stage 3", use_zero=True, zero_stage=3),
    R(
        "grad_aggregation",
        "median",
        f"grad_aggregation='median' {UNREAD} inference_only=True",
        byzantine_b=0,
        **INFER,
    ),
    A("grad_aggregation", "zeno", "2 replicas > b = 1"),
    R("byzantine_b", -1, "byzantine_b must be an int >= 0"),
    R("byzantine_b", True, f"byzantine_b {TYPE} an int >= 0"),
    R(
        "byzantine_b",
        3,
        f"byzantine_b=3 {UNREAD} grad_aggregation='mean': it is read only by the robust modes",
    ),
    A("byzantine_b", 0, "0 suspects none: the mean, whatever the mode (documented)"),
    R("zeno_gamma", 0, "zeno_gamma must be > 0", grad_aggregation="zeno"),
    R("zeno_gamma", "x", f"zeno_gamma {TYPE} a number > 0"),
    R(
        "zeno_gamma",
        0.1,
        f"zeno_gamma=0.1 {UNREAD} grad_aggregation='mean': it is read only by grad_aggregation='zeno'",
    ),
    A("zeno_gamma", 0.1, "Zeno's trial step", grad_aggregation="zeno"),
    R("zeno_rho", -1.0, "zeno_rho must be >= 0", grad_aggregation="zeno"),
    R(
        "zeno_rho",
        1e-3,
        f"zeno_rho=0.001 {UNREAD} grad_aggregation='trimmed_mean'",
        grad_aggregation="trimmed_mean",
        byzantine_b=0,
    ),
    A("zeno_rho", 0.0, "Zeno without the norm penalty", grad_aggregation="zeno"),
    R("torch_compile", "yes", f"torch_compile {TYPE} True, False or a dict"),
    R("torch_compile", {"bogus": 1}, r"torch_compile: unknown option\(s\) \['bogus'\]"),
    R("torch_compile", {"backend": print}, r"torch_compile\['backend'\] must be a backend's name"),
    R(
        "torch_compile",
        True,
        "torch_compile cannot be used with ZeRO stage 3.*use zero_stage=1 or 2",
        use_zero=True,
        zero_stage=3,
    ),
    A("torch_compile", {"backend": "aot_eager"}, "compiled when loaded"),
    R("trace_time_budget_s", -1, "trace_time_budget_s must be a number of seconds >= 0"),
    R("trace_time_budget_s", "30", f"trace_time_budget_s {TYPE} a number of seconds or None"),
    R("trace_time_budget_s", True, f"trace_time_budget_s {TYPE} a number of seconds or None"),
    A("trace_time_budget_s", None, "no limit (documented)"),
]


def _id(row: Row) -> str:
    also = ",".join(f"{k}={v!r}" for k, v in row.also.items())
    return f"{row.field}={row.value!r}{'[' + also + ']' if also else ''}{'-env' if row.env else ''}"


@pytest.mark.parametrize("row", TABLE, ids=[_id(r) for r in TABLE])
def test_row(row: Row, monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in row.env.items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    kwargs = {**BASE, **row.also, row.field: row.value}
    if row.refused:
        with pytest.raises(ConfigError) as info:
            ComputeConfig(**kwargs)
        message = str(info.value)
        assert re.search(rf"\b{row.field}\b", message), message  # names the field
        assert re.search(row.refused, message), message
    else:
        assert row.why
        cfg = ComputeConfig(**kwargs)
        assert ComputeConfig.from_dict(cfg.to_dict()) == cfg or callable(row.value)


def test_every_field_has_a_row_with_a_refused_value() -> None:
    names = [f.name for f in dataclasses.fields(ComputeConfig)]
    refused = {r.field for r in TABLE if r.refused}
    assert not sorted(set(names) - refused), (
        f"ComputeConfig fields without a refused row: {sorted(set(names) - refused)}"
    )
    assert {r.field for r in TABLE} <= set(names)
    from nnscaler.config_checks import FIELD_TYPES  # here: the rows above run on code without it

    assert set(FIELD_TYPES) == set(names)


def test_a_new_field_without_a_type_entry_is_refused() -> None:
    """A field added to ComputeConfig without an entry in config_checks.FIELD_TYPES fails construction."""
    grown = dataclasses.make_dataclass(
        "Grown",
        [("new_knob", int, dataclasses.field(default=0, kw_only=True))],
        bases=(ComputeConfig,),
        frozen=True,
    )
    with pytest.raises(
        ConfigError, match=r"FIELD_TYPES has no entry for ComputeConfig field\(s\) \['new_knob'\]"
    ):
        grown(2, 2)


def test_table_size() -> None:
    """The note reports it: fields x values (refused, accepted)."""
    refused = sum(1 for r in TABLE if r.refused)
    assert len({r.field for r in TABLE}) == len(dataclasses.fields(ComputeConfig))
    assert refused >= 2 * len(dataclasses.fields(ComputeConfig))
