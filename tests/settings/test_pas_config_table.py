"""Every pas_config key of every built-in policy either applies or is refused (issue 41).

The keys of a policy are the fields of its options dataclass (`nnscaler.policies.options.POLICY_OPTIONS`,
the same declaration that validates them). One row per (key, value): a refused row is the message the
plan must fail with (a ConfigError / PlanError naming the key), an accepted row says why the value is
valid. Each policy's every key needs a refused row; a key without one fails the table. Rows are planned
with `make_plan` on a traced graph and a ComputeConfig of the devices (no processes); `leaf_modules`
rows are captured, as capture is what reads them.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import pytest

from nnscaler import ComputeConfig
from nnscaler.errors import ConfigError, PlanError
from nnscaler.graph.capture import capture
from nnscaler.parallel.resolved_policy import resolve_pas_policy
from nnscaler.policies import make_plan
from nnscaler.policies.options import POLICY_OPTIONS
from tests import zoo

ALL = tuple(POLICY_OPTIONS)
PIPE = ("pp", "hybrid", "autodist")
CP = ("tp", "hybrid")

BASE: dict[str, tuple[int, bool, dict[str, Any]]] = {
    "dp": (1, False, {}),
    "data": (2, False, {}),
    "tp": (2, False, {}),
    "pp": (2, True, {"pipeline_nmicros": 2}),
    "hybrid": (4, True, {"pipeline_nmicros": 2, "pp_size": 2, "pipeline_nstages": 2}),
    "autodist": (2, False, {}),
}
"""Per policy: plan_ngpus, use_end2end and pas_config a row starts from (a valid plan)."""


@dataclass(frozen=True)
class Row:
    key: str
    value: Any
    policies: tuple[str, ...]
    refused: str = ""
    """Regex of the refusal ("" = accepted)."""
    why: str = ""
    also: dict[str, Any] = field(default_factory=dict)
    """Other pas_config keys the value is tried with."""
    n: int | None = None
    """plan_ngpus (default: the policy's BASE)."""
    e2e: bool | None = None
    model: str = "gpt"
    warns: str = ""
    """Accepted with a warning matching this."""


def R(key: str, value: Any, policies: tuple[str, ...], refused: str, **kw: Any) -> Row:
    return Row(key, value, policies, refused=refused, **kw)


def A(key: str, value: Any, policies: tuple[str, ...], why: str, **kw: Any) -> Row:
    return Row(key, value, policies, why=why, **kw)


TYPE = "of policy '\\w+' must be"
NOT_READ = "cannot apply under policy"
GPT = "module classes here: \\['Block'"

TABLE: list[Row] = [
    # ---- every policy
    R("recompute_modules", 3, ALL, TYPE + " str or a list of str or None"),
    R("recompute_modules", "Nope", ALL, f"recompute_modules entry 'Nope' matches no module; {GPT}"),
    A("recompute_modules", "Block", ALL, "each Block recomputed in backward"),
    R("leaf_modules", 5, ALL, TYPE + " str or a list of str or None"),
    R(
        "leaf_modules",
        "nope",
        ALL,
        r"pas_config\['leaf_modules'\] names 'nope', which is neither a submodule path",
    ),
    A(
        "leaf_modules",
        "transformer.h.0.mlp",
        ALL,
        "that submodule runs eagerly as one op",
        warns=r"runs as one opaque op: named in pas_config\['leaf_modules'\]",
    ),
    R("auto_leaf_modules", "yes", ALL, TYPE + " bool"),
    A("auto_leaf_modules", False, ALL, "capture fails on data-dependent Python instead of making a leaf"),
    # ---- context parallelism (tp, hybrid)
    R("cp_size", 0, CP, r"'cp_size'.* must be >= 1"),
    R("cp_size", "2", CP, TYPE + " int"),
    R("cp_size", 3, ("tp",), r"cp_size'\]=3 does not divide plan_ngpus \(2\)"),
    R("cp_size", 3, ("hybrid",), "cp_size.*3.*(divide|devices)"),
    R("cp_size", 2, ("tp",), r"cp_size'\] > 1 but the model has no self-attention", model="mlp"),
    A("cp_size", 2, CP, "the sequence of attention split over 2 devices"),
    R("cp_kind", "ringy", CP, TYPE + " 'zigzag' or 'ring'"),
    R("cp_kind", "ring", CP, f"cp_kind'\\]='ring' {NOT_READ} '\\w+': it is read only with cp_size > 1"),
    A("cp_kind", "ulysses", CP, "Ulysses all-to-all", also={"cp_size": 2}),
    R("cp_ulysses_size", 0, CP, r"'cp_ulysses_size'.* must be >= 1"),
    R(
        "cp_ulysses_size",
        2,
        CP,
        f"cp_ulysses_size'\\]=2 {NOT_READ}.*read only with cp_kind 'hybrid'",
        also={"cp_size": 2},
    ),
    R(
        "cp_ulysses_size",
        3,
        ("tp",),
        "cp_ulysses_size'\\]=3 with cp_size 4",
        also={"cp_size": 4, "cp_kind": "hybrid"},
        n=4,
    ),
    A(
        "cp_ulysses_size",
        2,
        ("tp",),
        "Ulysses groups of 2 in a ring of 2",
        also={"cp_size": 4, "cp_kind": "hybrid"},
        n=4,
    ),
    # ---- expert parallelism (tp, hybrid)
    R("ep_size", 0, CP, r"'ep_size'.* must be >= 1"),
    R("ep_size", 3, ("tp",), r"ep_size'\]=3 does not divide the 2 devices"),
    R("ep_size", 2, CP, r"ep_size'\]=2 but the model has no recognised mixture-of-experts layer"),
    A("ep_size", 1, CP, "no expert parallelism (the default)"),
    # ---- pipelines (pp, hybrid, autodist)
    R("pipeline_nmicros", 0, PIPE, r"'pipeline_nmicros'.* must be >= 1"),
    R("pipeline_nmicros", "4", PIPE, TYPE + " int or None"),
    R("pipeline_nmicros", None, ("pp", "hybrid"), r"pipelines need pas_config\['pipeline_nmicros'\]"),
    A(
        "pipeline_nmicros",
        2,
        ("autodist",),
        "without use_end2end too: the search costs a step of 2 micro-batches (gradient accumulation)",
    ),
    A("pipeline_nmicros", 4, PIPE, "micro-batches per train_step", e2e=True),
    R("pipeline_nstages", 0, PIPE, r"'pipeline_nstages'.* must be >= 1"),
    R("pipeline_nstages", True, PIPE, TYPE + " int or 'auto'"),
    R("pipeline_nstages", 3, ("pp",), r"pipeline_nstages \(3\) must be a multiple of plan_ngpus \(2\)"),
    R(
        "pipeline_nstages",
        3,
        ("hybrid",),
        r"pp_size \(2\) must divide plan_ngpus \(4\) and pipeline_nstages \(3\)",
    ),
    R("pipeline_nstages", 3, ("autodist",), r"pipeline_nstages'\]=3 cannot split plan_ngpus=2", e2e=True),
    R("pipeline_nstages", 2, ("autodist",), r"pipeline_nstages'\]=2 needs ComputeConfig\(use_end2end=True\)"),
    A("pipeline_nstages", 2, PIPE, "two stages", e2e=True, also={"pipeline_nmicros": 2}),
    R("pipeline_scheduler", "zb", PIPE, TYPE + " '1f1b' or 'gpipe'"),
    R(
        "pipeline_scheduler",
        "gpipe",
        ("pp",),
        r"need pipeline_scheduler '1f1b_interleaved' \(or, for exactly two per group, the V-shaped 'zbv' / "
        r"'dualpipev'\), not 'gpipe'",
        also={"pipeline_nstages": 4},
    ),
    R(
        "pipeline_scheduler",
        "gpipe",
        ("autodist",),
        f"pipeline_scheduler'\\]='gpipe' {NOT_READ}.*use_end2end=True",
    ),
    R(
        "pipeline_scheduler",
        "gpipe",
        ("autodist",),
        "pipeline_nstages is 1: no pipeline",
        e2e=True,
        also={"pipeline_nstages": 1},
    ),
    A("pipeline_scheduler", "gpipe", PIPE, "GPipe's schedule", e2e=True, also={"pipeline_nmicros": 2}),
    R("pipeline_pivots", 3, PIPE, TYPE + " str or a list of str or None"),
    R("pipeline_pivots", "Nope", PIPE, r"pipeline_pivots \['Nope'\] match no module of the model", e2e=True),
    R(
        "pipeline_pivots",
        "Block",
        ("pp", "hybrid"),
        f"pipeline_pivots'\\]='Block' {NOT_READ}.*pipeline_stages places every stage",
        also={"pipeline_stages": ["transformer.h.1"]},
    ),
    R("pipeline_pivots", "Block", ("autodist",), f"pipeline_pivots'\\]='Block' {NOT_READ}.*use_end2end=True"),
    A("pipeline_pivots", "Block", PIPE, "stages start at Blocks", e2e=True),
    R("pipeline_stages", ["a", 3], PIPE, TYPE + " a list of str or None"),
    R(
        "pipeline_stages",
        ["nope"],
        ("pp", "hybrid"),
        r"pipeline_stages'\] names module 'nope', which runs no op",
    ),
    R("pipeline_stages", ["transformer.h.1"], ("autodist",), r"pipeline_stages'\] is not read by autodist"),
    A("pipeline_stages", ["transformer.h.1"], ("pp", "hybrid"), "stage 1 starts at block 1"),
    # ---- hybrid
    R("pp_size", 0, ("hybrid",), r"'pp_size'.* must be >= 1"),
    R("pp_size", 3, ("hybrid",), r"pp_size \(3\) must divide plan_ngpus \(4\)"),
    A("pp_size", 4, ("hybrid",), "a stage per device", also={"pipeline_nstages": 4}),
    # ---- autodist
    R("cluster", 3, ("autodist",), TYPE + " str or dict or None"),
    R("cluster", "nope", ("autodist",), "cluster 'nope' is neither a file nor a shipped example"),
    A("cluster", "h100x8", ("autodist",), "a shipped cluster"),
    R("mem_constraint", "8", ("autodist",), TYPE + " float or None"),
    R("mem_constraint", -1.0, ("autodist",), f"mem_constraint'\\]=-1.0 {NOT_READ}.*must be > 0"),
    R("mem_constraint", 1e-9, ("autodist",), "found no partition .* within the memory"),
    A("mem_constraint", 8.0, ("autodist",), "8 GB per device"),
    R("zero_stage", 4, ("autodist",), r"pas_config\['zero_stage'\] must be 0, 1, 2 or 3"),
    R("zero_stage", -1, ("autodist",), r"'zero_stage'.* must be >= 0"),
    A(
        "zero_stage",
        2,
        ("autodist",),
        "a cost-model assumption: it changes the plan chosen (planning for a ZeRO run)",
    ),
    R("partition_constraints_path", 3, ("autodist",), TYPE + " str or None"),
    R(
        "partition_constraints_path",
        "/nope.yaml",
        ("autodist",),
        r"partition_constraints_path'\] = '/nope.yaml': no such file",
    ),
    R("partition_constraints", "x", ("autodist",), TYPE + " a list of dict or None"),
    R(
        "partition_constraints",
        [{"name": "linear", "parent_module": "Nope"}],
        ("autodist",),
        "matches no op of the model .*'Nope'",
    ),
    A(
        "partition_constraints",
        [{"name": "linear", "parent_module": "MLP", "allowed_partition_dims": []}],
        ("autodist",),
        "MLP linears stay whole",
    ),
    R("load_plan_path", 3, ("autodist",), TYPE + " str or None"),
    R("load_plan_path", "/nope.json", ("autodist",), r"load_plan_path'\] = '/nope.json': no such file"),
    R("save_plan_path", 3, ("autodist",), TYPE + " str or None"),
    A("save_plan_path", "{tmp}/plan.json", ("autodist",), "the chosen plan is written there"),
    R("use_bf16", "yes", ("autodist",), TYPE + " bool"),
    A("use_bf16", True, ("autodist",), "costed in bf16"),
    R("use_fp16", 1, ("autodist",), TYPE + " bool"),
    R(
        "use_fp16",
        True,
        ("autodist",),
        f"use_fp16'\\]=True {NOT_READ}.*use_bf16 is set too",
        also={"use_bf16": True},
    ),
    A("use_fp16", True, ("autodist",), "costed in fp16"),
    R("transient_mem_coef", "2", ("autodist",), TYPE + " float"),
    R("transient_mem_coef", -1.0, ("autodist",), f"transient_mem_coef'\\]=-1.0 {NOT_READ}.*must be >= 0"),
    A("transient_mem_coef", 0.5, ("autodist",), "smaller transient buffers"),
    R("profile_db_path", 3, ("autodist",), TYPE + " str or None"),
    R("profile_db_path", "/nope.json", ("autodist",), r"profile_db_path'\] = '/nope.json': no such file"),
    R("solver", "gurobi", ("autodist",), TYPE + " 'auto' or 'cbc' or 'highs'"),
    R("solver", "highs", ("autodist",), "HiGHS is not installed: `pip install highspy`"),
    A("solver", "cbc", ("autodist",), "CBC"),
    R(
        "tp_mesh",
        [2, 2],
        ("autodist",),
        f"tp_mesh'\\]=\\[2, 2\\] {NOT_READ}.*needs 4 devices per stage \\(plan_ngpus=2\\)",
    ),
    R(
        "tp_mesh",
        [2, 2],
        ("autodist",),
        "a stage has .* = 2 devices; pin a mesh of that size or pipeline_nstages=1",
        n=4,
        e2e=True,
        also={"pipeline_nstages": 2, "pipeline_nmicros": 2},
    ),
    R(
        "tp_mesh",
        [1, 2],
        ("autodist",),
        r"tp_mesh'\] must be 'auto', 'off', \[a, b\] or \[a, b, c\] with each > 1",
    ),
    R("tp_mesh", "2x2", ("autodist",), r"tp_mesh'\] must be 'auto', 'off'"),
    R("tp_mesh", [2.0, 2.0], ("autodist",), TYPE + " str or a list of int"),
    A(
        "tp_mesh",
        [2, 2],
        ("autodist",),
        "offered to the search for the 4 devices (it may still find 1-D splits cheaper)",
        n=4,
    ),
    R("cp_size", 0, ("autodist",), r"'cp_size'.* must be >= 1"),
    R("cp_size", 3, ("autodist",), r"cp_size'\]=3 does not divide plan_ngpus=2"),
    R("cp_size", 2, ("autodist",), "no self-attention", model="mlp"),
    A("cp_size", 2, ("autodist",), "sequence split over 2 devices"),
    R("cp_kind", "ringy", ("autodist",), TYPE + " 'auto' or 'zigzag'"),
    R("cp_kind", "ring", ("autodist",), f"cp_kind'\\]='ring' {NOT_READ}.*cp_size is 1", also={"cp_size": 1}),
    A("cp_kind", "ring", ("autodist",), "the kind of a searched cp degree"),
    R("cp_ulysses_size", 1, ("autodist",), r"'cp_ulysses_size'.* must be >= 2"),
    R(
        "cp_ulysses_size",
        2,
        ("autodist",),
        f"cp_ulysses_size'\\]=2 {NOT_READ}.*read only for cp_kind 'hybrid'",
        also={"cp_kind": "ring"},
    ),
    A("cp_ulysses_size", 2, ("autodist",), "constrains the hybrid candidates the search costs"),
    R("ep_size", 0, ("autodist",), r"'ep_size'.* must be >= 1"),
    R("ep_size", 2, ("autodist",), "no recognised mixture-of-experts layer"),
    A("ep_size", "auto", ("autodist",), "searched where the model has experts (none here: 1)"),
    R("update_freq", 0, ("autodist",), r"'update_freq'.* must be >= 1"),
    R("update_freq", "2", ("autodist",), TYPE + " int or a list of int or None"),
    R(
        "update_freq",
        2,
        ("autodist",),
        f"update_freq'\\]=2 {NOT_READ}.*pipeline_nmicros is given",
        also={"pipeline_nmicros": 4},
    ),
    A(
        "update_freq",
        [2, 4],
        ("autodist",),
        "nnScaler 0.8's name of pipeline_nmicros (its first value, as 0.8)",
        e2e=True,
    ),
    R("task_name", 3, ("autodist",), TYPE + " str or None"),
    A(
        "task_name",
        "x",
        ("autodist",),
        "nnScaler 0.8's label, accepted with a warning naming save_plan_path",
        warns="task_name.*ignored.*save_plan_path",
    ),
]


def _rows() -> list[tuple[str, Row]]:
    return [(p, r) for r in TABLE for p in r.policies]


def _id(item: tuple[str, Row]) -> str:
    policy, r = item
    extra = f"[{','.join(f'{k}={v!r}' for k, v in r.also.items())}]" if r.also else ""
    return f"{policy}-{r.key}={r.value!r}{extra}{'-n' + str(r.n) if r.n else ''}{'-' + r.model if r.model != 'gpt' else ''}"


@pytest.fixture(scope="module")
def graphs():
    out = {}
    for name in ("gpt", "mlp"):
        model, make_batch = zoo.build(name)
        out[name] = (model, make_batch(0, 4), capture(model, make_batch(0, 4), both_modes=False))
    return out


def _plan(policy: str, row: Row, graphs, tmp_path) -> None:
    n, e2e, base = BASE[policy]
    value = row.value.replace("{tmp}", str(tmp_path)) if isinstance(row.value, str) else row.value
    pas = {**base, **row.also, row.key: value}
    cfg = ComputeConfig(
        row.n or n, row.n or n, use_end2end=e2e if row.e2e is None else row.e2e, pas_config=pas
    )
    model, batch, graph = graphs[row.model]
    resolved = resolve_pas_policy(policy, cfg.pas_config)  # what parallelize does before tracing
    if row.key in ("leaf_modules", "auto_leaf_modules"):  # read by capture
        graph = capture(
            model,
            batch,
            both_modes=False,
            leaf_modules=list(resolved.leaf_modules),
            auto_leaf_modules=resolved.auto_leaf_modules,
        )
    make_plan(graph, policy, cfg)


@pytest.mark.parametrize("item", _rows(), ids=[_id(i) for i in _rows()])
def test_row(item: tuple[str, Row], graphs, tmp_path) -> None:
    policy, row = item
    assert row.key in {f.name for f in dataclasses.fields(POLICY_OPTIONS[policy])}, "not a key of the policy"
    if row.key == "solver" and row.value == "highs" and row.refused:
        from nnscaler.policies.autodist.spmd import available_solvers

        if "highs" in available_solvers():
            pytest.skip("highspy is installed here: 'highs' applies")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if row.refused:
            with pytest.raises((ConfigError, PlanError)) as info:
                _plan(policy, row, graphs, tmp_path)
            message = str(info.value)
            assert row.key in message, message  # names the key
            assert re.search(row.refused, message), message
            return
        _plan(policy, row, graphs, tmp_path)
    assert row.why
    said = [str(w.message) for w in caught if "pas_config" in str(w.message) or row.key in str(w.message)]
    if row.warns:
        assert any(re.search(row.warns, s) for s in said), said
    else:
        assert not said, said


@pytest.mark.parametrize("policy", ALL)
def test_unknown_keys_are_refused(policy: str, graphs) -> None:
    n, e2e, base = BASE[policy]
    cfg = ComputeConfig(n, n, use_end2end=e2e, pas_config={**base, "tp_mesh_size": 2})
    with pytest.raises(ConfigError, match=f"'tp_mesh_size' is not an option of policy '{policy}'"):
        resolve_pas_policy(policy, cfg.pas_config)
    with pytest.raises(ConfigError, match=f"'tp_mesh_size' is not an option of policy '{policy}'"):
        make_plan(graphs["gpt"][2], policy, cfg)  # the planner alone, without parallelize, too


def test_every_key_of_every_policy_has_a_refused_row() -> None:
    refused = {(p, r.key) for p, r in _rows() if r.refused}
    missing = sorted(
        (p, f.name)
        for p, cls in POLICY_OPTIONS.items()
        for f in dataclasses.fields(cls)
        if (p, f.name) not in refused
    )
    assert not missing, f"pas_config keys without a refused row: {missing}"


def test_table_size() -> None:
    """The note reports it: (policy, key) pairs x values."""
    keys = {(p, f.name) for p, cls in POLICY_OPTIONS.items() for f in dataclasses.fields(cls)}
    assert len(keys) >= 60 and sum(1 for _, r in _rows() if r.refused) >= 2 * len(keys)


def test_the_offline_planner_refuses_a_mesh_that_cannot_apply(graphs) -> None:
    """`python -m nnscaler.plan --plan-ngpus 2 --mesh 2x2` searches without make_plan: refused there too."""
    from nnscaler.policies.autodist.cluster import load_cluster
    from nnscaler.policies.autodist.offline import plan_offline

    with pytest.raises(PlanError, match=r"tp_mesh'\]=\[2, 2\] cannot apply .*needs 4 devices per stage"):
        plan_offline(
            graphs["gpt"][2], load_cluster("cpu_gloo"), 2, plan_ngpus=2, pas_config={"tp_mesh": [2, 2]}
        )


def test_a_pinned_mesh_keeps_the_search_on_stages_of_its_size(graphs) -> None:
    """plan_ngpus=4 with tp_mesh [2, 2] and the stage count searched: a 2-stage pipeline (stages of 2
    devices) would drop the mesh, so only stages of 4 devices are planned."""
    pas = {"tp_mesh": [2, 2], "pipeline_nmicros": 2}
    plan = make_plan(graphs["gpt"][2], "autodist", ComputeConfig(4, 4, use_end2end=True, pas_config=pas))
    assert plan.pipeline is None and "pp=1 tp=4" in plan.notes[0], plan.notes
