"""autodist honours every constraint it is given or refuses it with a PlanError / ConfigError naming what
cannot be done and why: contradictory partition constraints (the rule and the op), a stage count the
devices cannot give, cluster files that do not parse or hold wrong fields (the file, line and column, the
field), and a model that fits no partition on the cluster planned for (which cluster, how to name another)."""

from __future__ import annotations

import pytest

from nnscaler import ComputeConfig
from nnscaler.errors import ConfigError, PlanError
from nnscaler.policies import make_plan
from nnscaler.policies.autodist import load_cluster

NEVER_LINEAR = {"name": "linear", "allowed_partition_dims": [], "replica_allowed": False}


def _plan(graph, ngpus: int = 2, end2end: bool = False, **pas):
    cfg = ComputeConfig(ngpus, ngpus, use_end2end=end2end, pas_config={"cluster": "cpu_gloo", **pas})
    return make_plan(graph, "autodist", cfg)


def test_contradictory_constraint_names_the_rule_and_the_op(zoo_graphs):
    graph = zoo_graphs["llama"][0]
    with pytest.raises(PlanError) as err:
        _plan(graph, partition_constraints=[NEVER_LINEAR])
    msg = str(err.value)
    assert "pas_config['partition_constraints'][0]" in msg and "'replica_allowed': False" in msg
    first = next(n for n in graph.nodes if n.op == "aten.linear.default")
    assert f"node {first.name} (aten.linear.default)" in msg
    assert first.module_path in msg and "modeling_llama.py:" in msg  # module path and source line
    assert "forbids replication and every split" in msg and "'n'" in msg  # the splits it could take


def test_contradictory_constraint_from_a_file_names_the_file(zoo_graphs, tmp_path):
    path = tmp_path / "pc.yaml"
    path.write_text("- name: linear\n  allowed_splits: []\n  replica_allowed: false\n")
    with pytest.raises(PlanError, match=r"partition_constraints_path'\] \(.*pc\.yaml\)\[0\]"):
        _plan(zoo_graphs["llama"][0], partition_constraints_path=str(path))


def test_a_split_the_degree_does_not_divide_is_named(zoo_graphs):
    """Only kv-head splits allowed, 2 kv heads, 4 devices: the heads' size is the reason."""
    graph = zoo_graphs["llama"][0]
    heads_only = {"name": "scaled_dot_product_attention", "allowed_splits": ["g"], "replica_allowed": False}
    with pytest.raises(PlanError, match=r"'g' has size 2, which 4 devices do not divide"):
        _plan(graph, ngpus=4, partition_constraints=[heads_only], tp_mesh="off")
    # satisfiable on 2 devices: every attention is split over its heads, as asked
    plan = _plan(graph, partition_constraints=[heads_only])
    sdpa = [n for n in graph.nodes if "scaled_dot_product_attention" in n.op]
    assert sdpa and all(plan.node(n.name).split == "g" for n in sdpa)


def test_satisfiable_constraints_plan_as_before(zoo_graphs):
    graph = zoo_graphs["llama"][0]
    free = _plan(graph)
    allow_all = [{"name": "linear", "replica_allowed": True}]
    assert _plan(graph, partition_constraints=allow_all).nodes == free.nodes


def test_stage_count_the_devices_cannot_give_is_not_blamed_on_memory(zoo_graphs):
    graph = zoo_graphs["llama"][0]
    with pytest.raises(PlanError) as err:
        _plan(graph, end2end=True, pipeline_nstages=3, mem_constraint=1000)
    msg = str(err.value)
    assert "pipeline_nstages']=3" in msg and "plan_ngpus=2" in msg and "[1, 2]" in msg
    assert "memory" not in msg
    with pytest.raises(PlanError, match=r"pipeline_nstages'\]=2 needs ComputeConfig\(use_end2end=True\)"):
        _plan(graph, pipeline_nstages=2, mem_constraint=1000)


def test_every_refused_configuration_is_listed(zoo_graphs):
    """No memory at all: the whole-mesh plan and every pipeline are refused, each with its reason."""
    graph = zoo_graphs["llama"][0]
    with pytest.raises(PlanError) as err:
        _plan(graph, end2end=True, mem_constraint=1e-6)
    msg = str(err.value)
    assert msg.startswith("autodist: no configuration of 2 devices could be planned:")
    assert "pp=1 tp=2" in msg and "pp=2 tp=1" in msg and "mem_constraint" in msg


def test_malformed_cluster_yaml_names_file_line_and_column(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("device: h100\nnodes: [1\n")
    with pytest.raises(ConfigError) as err:
        load_cluster(str(path))
    msg = str(err.value)
    assert str(path) in msg and "line 3, column 1" in msg and "line 2, column 8" in msg
    assert "<unicode string>" not in msg


@pytest.mark.parametrize(
    "text, field",
    [
        ("device: h100\nnode: 2\n", r"unknown fields \['node'\] \('node': did you mean 'nodes'\?\)"),
        ("device: h100\nnodes: two\n", r"'nodes' must be an integer, got 'two'"),
        ("device: h100\nintra_node: {bandwidth_gbs: fast}\n", r"'intra_node.bandwidth_gbs' must be a number"),
        ("device: h100\nmemory_gb: lots\n", r"'memory_gb' must be a number"),
        ("device: tpu\n", r"unknown device 'tpu'"),
    ],
)
def test_cluster_yaml_with_wrong_fields_names_file_and_field(tmp_path, text, field):
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=field) as err:
        load_cluster(str(path))
    assert str(err.value).startswith(f"cluster file {path}: ")


def test_no_partition_fits_names_the_cluster_and_how_to_name_another(zoo_graphs, monkeypatch):
    """What a CPU-only machine that names no cluster sees: the cluster it planned for, with its memory."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = ComputeConfig(2, 2, pas_config={"mem_constraint": 1e-6})
    with pytest.raises(PlanError) as err:
        make_plan(zoo_graphs["llama"][0], "autodist", cfg)
    msg = str(err.value)
    assert "cluster 'CPU processes over gloo' (1 node(s) x 8 cpu, 8 GB each)" in msg
    assert "pas_config['cluster']" in msg and "python -m nnscaler.plan --cluster" in msg
    assert "mem_constraint" in msg
