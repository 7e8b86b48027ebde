"""Measured op costs: the profiler's database overrides the analytic compute time where present."""

from __future__ import annotations

from nnscaler import ComputeConfig
from nnscaler.policies import make_plan
from nnscaler.policies.autodist import planner_setup, solve_spmd
from nnscaler.policies.autodist.choices import node_choices, op_key
from nnscaler.policies.autodist.context import stage_context
from nnscaler.policies.autodist.memory import MemoryModel
from nnscaler.policies.autodist.profiler import ProfileDB, profile_graph


def test_profile_and_use_measured_times(zoo_graphs, tmp_path):
    graph = zoo_graphs["mlp"][0]
    db = profile_graph(graph, ways=(1, 2), repeats=1)
    linear = next(n for n in graph.nodes if n.op == "aten.linear.default")
    x, w = (graph.values[r].meta.shape for r in linear.input_names()[:2])
    key = op_key(
        linear.op,
        [x, w]
        + ([graph.values[linear.input_names()[2]].meta.shape] if len(linear.input_names()) > 2 else []),
        "float32",
    )
    assert key in db.entries and db.entries[key] > 0
    path = db.save(tmp_path / "ops.json")
    assert ProfileDB.load(path).entries == db.entries
    # a made-up measurement changes the cost the search sees
    fake = {k: 1.0 for k in db.entries}
    setup = planner_setup(graph, ComputeConfig(2, 2, pas_config={"cluster": "cpu_gloo"}))
    ctx = stage_context(setup, 1)
    measured = type(ctx)(**{**ctx.__dict__, "measured": fake})
    whole = node_choices(graph, linear, measured, MemoryModel(), set()).choices[0]
    assert whole.compute == 1.0
    assert node_choices(graph, linear, ctx, MemoryModel(), set()).choices[0].compute < 1.0
    assert solve_spmd(graph, measured, setup.memory).time > solve_spmd(graph, ctx, setup.memory).time
    plan = make_plan(
        graph,
        "autodist",
        ComputeConfig(2, 2, pas_config={"cluster": "cpu_gloo", "profile_db_path": str(path)}),
    )
    assert plan.policy == "autodist"


def test_database_carries_links_and_step_overhead(zoo_graphs, tmp_path):
    """Measured links replace the cluster file's; the harness overhead leaves the entries and is
    charged once per micro-batch instead."""
    graph = zoo_graphs["mlp"][0]
    db = profile_graph(graph, ways=(1,), repeats=1)
    assert db.step_overhead_s > 0
    db.links["intra_node"] = {"bandwidth_gbs": 0.5, "latency_us": 700.0}
    path = db.save(tmp_path / "ops.json")
    again = ProfileDB.load(path)
    assert again.links == db.links and again.step_overhead_s == db.step_overhead_s
    cfg = ComputeConfig(1, 2, pas_config={"cluster": "cpu_gloo", "profile_db_path": str(path)})
    setup = planner_setup(graph, cfg)
    assert (setup.cluster.intra_node.bandwidth_gbs, setup.cluster.intra_node.latency_us) == (0.5, 700.0)
    assert setup.step_overhead == db.step_overhead_s
    plain = planner_setup(graph, ComputeConfig(1, 2, pas_config={"cluster": "cpu_gloo"}))
    from nnscaler.policies.autodist.context import fixed_costs, local_weight_bytes

    with_db = fixed_costs(graph, setup, stage_context(setup, 1), nmicros=4)
    assert abs(with_db - 4 * db.step_overhead_s) < 1e-12  # 4 micro-batches' overhead
    # the gradient sync pays one bucket's all-reduce latency (2 steps of 700 us for 2 replicas); it is
    # the sync's, which overlaps backward (step_time.py), not a fixed cost
    ctx = stage_context(setup, 1)
    latency = setup.memory.grad_sync_latency(local_weight_bytes(graph, ctx), ctx, setup.bucket_bytes)
    assert abs(latency - 2 * 700e-6) < 1e-8  # (and one byte on the wire)
    ctx = stage_context(plain, 1)
    plain_latency = plain.memory.grad_sync_latency(local_weight_bytes(graph, ctx), ctx, plain.bucket_bytes)
    assert abs(plain_latency - 2 * 50e-6) < 1e-8  # cpu_gloo: 50 us
    assert fixed_costs(graph, plain, stage_context(plain, 1), nmicros=4) == 0.0


def test_fit_link_recovers_alpha_and_beta():
    from nnscaler.policies.autodist.cluster import LinkSpec
    from nnscaler.policies.autodist.comm import ring_all_reduce
    from nnscaler.policies.autodist.profiler import fit_link

    truth = LinkSpec(bandwidth_gbs=2.0, latency_us=120.0)
    samples = [(float(n), ring_all_reduce(n, 4, truth)) for n in (1e3, 1e5, 1e6, 4e6)]
    fitted = fit_link(samples, 4)
    assert abs(fitted.bandwidth_gbs - 2.0) < 1e-6 and abs(fitted.latency_us - 120.0) < 1e-6


def test_profile_link_on_two_gloo_ranks(tmp_path):
    from tests.dist_util import spawn

    links = spawn(_link_rank, 2, tmp_path)
    assert links[0] == links[1]  # every rank gets rank 0's fit
    bw, lat = links[0]
    assert bw > 0 and lat >= 0


def _link_rank(rank: int, world_size: int) -> tuple[float, float]:
    from nnscaler.policies.autodist.profiler import profile_link

    link = profile_link(sizes=(1 << 10, 1 << 16), repeats=3)
    return link.bandwidth_gbs, link.latency_us


def test_profiler_cli_adds_to_a_database(tmp_path):
    """`python -m nnscaler.profiler` traces a builder's model, times its ops on this machine's device
    and adds them to the file (a second model's ops join the first's)."""
    from nnscaler.cli.profile import main

    out = tmp_path / "ops.json"
    main(["--model", "tests.zoo.build_mlp", "--ways", "1,2", "--repeats", "1", "--out", str(out)])
    first = ProfileDB.load(out)
    assert first.device == "cpu" and first.entries and first.step_overhead_s > 0
    assert any(k.startswith("aten.linear") for k in first.entries)
    main(["--model", "tests.zoo.build_gpt", "--ways", "1", "--repeats", "1", "--out", str(out)])
    both = ProfileDB.load(out)
    assert set(first.entries) < set(both.entries)


def test_one_database_holds_one_kind_of_device(zoo_graphs):
    import pytest

    with pytest.raises(ValueError, match="one kind of device"):
        profile_graph(zoo_graphs["mlp"][0], db=ProfileDB("cuda"), device="cpu")


def test_harness_overhead_leaves_each_op_its_own_cost():
    """The harness is what a longer chain of the op does not add to: an op that sleeps 2 ms is
    measured at 2 ms or more, and none of that is taken for the harness (taking a cheap op's whole
    timing for the harness left every entry short by that op's dispatch cost)."""
    import time

    import torch

    from nnscaler.policies.autodist.profiler import _per_op_and_rest

    def slow_op(t):
        time.sleep(0.002)
        return t * 1.0

    per_op, rest = _per_op_and_rest(slow_op, 1, torch.device("cpu"))
    assert 0.002 <= per_op < 0.004
    assert 0.0 <= rest < 0.002


def test_free_ops_cost_their_measured_dispatch(zoo_graphs, tmp_path):
    """A view moves no data but still costs dispatch and autograd time on the host: with a measured
    database every such op is charged the measured figure (analytically it stays free)."""
    graph = zoo_graphs["gpt"][0]
    db = profile_graph(graph, ways=(1,), repeats=1)
    assert db.free_op_s > 0
    path = db.save(tmp_path / "ops.json")
    assert ProfileDB.load(path).free_op_s == db.free_op_s
    view = next(n for n in graph.nodes if n.op == "aten.view.default")
    cfg = {"cluster": "cpu_gloo"}
    plain = planner_setup(graph, ComputeConfig(1, 1, pas_config=cfg))
    setup = planner_setup(graph, ComputeConfig(1, 1, pas_config={**cfg, "profile_db_path": str(path)}))
    assert setup.free_op == db.free_op_s
    charged = node_choices(graph, view, stage_context(setup, 1), MemoryModel(), set()).choices[0].compute
    assert charged == db.free_op_s
    assert node_choices(graph, view, stage_context(plain, 1), MemoryModel(), set()).choices[0].compute == 0.0


def test_views_cost_nothing_on_an_asynchronous_device():
    """Only where the host runs the ops (a CPU) is a view's dispatch a cost of the step; elsewhere the
    host's work overlaps the kernels queued before it."""
    import torch

    from nnscaler.policies.autodist.profiler import _free_op_time

    assert _free_op_time(1, torch.device("cpu")) > 0
    assert _free_op_time(1, torch.device("meta")) == 0.0


def test_databases_from_several_profiles_merge_figure_by_figure(tmp_path):
    """Profiles taken at several times merge to each figure's median; profiles taken at once on the
    ranks that train together merge to each figure's largest (a step waits for its slowest rank).
    An entry one profile lacks is not dragged down by it; devices must agree."""
    import pytest

    link = {"intra_node": {"bandwidth_gbs": 1.0, "latency_us": 900.0}}
    a = ProfileDB("cpu", {"op1": 1.0, "op2": 4.0}, link, 1e-4)
    b = ProfileDB(
        "cpu", {"op1": 3.0}, {"intra_node": {"bandwidth_gbs": 2.0, "latency_us": 500.0}}, 3e-4, 7e-6
    )
    c = ProfileDB("cpu", {"op1": 2.0, "op2": 6.0}, {}, 2e-4, 9e-6)
    median = ProfileDB.merged([a, b, c])
    assert median.entries == {"op1": 2.0, "op2": 5.0}
    assert median.links == {"intra_node": {"bandwidth_gbs": 1.5, "latency_us": 700.0}}
    assert median.step_overhead_s == pytest.approx(2e-4)
    assert median.free_op_s == pytest.approx(8e-6)  # a's 0 means "not measured"
    assert ProfileDB.load(median.save(tmp_path / "m.json")).entries == median.entries
    slowest = ProfileDB.merged([a, b, c], how="max")
    assert slowest.entries == {"op1": 3.0, "op2": 6.0}
    assert slowest.links == {"intra_node": {"bandwidth_gbs": 2.0, "latency_us": 900.0}}
    assert (slowest.step_overhead_s, slowest.free_op_s) == (3e-4, 9e-6)
    with pytest.raises(ValueError, match="different devices"):
        ProfileDB.merged([a, ProfileDB("cuda")])
    with pytest.raises(ValueError, match="at least one"):
        ProfileDB.merged([])
    with pytest.raises(ValueError, match="'median' or 'max'"):
        ProfileDB.merged([a], how="mean")
