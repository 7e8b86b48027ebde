"""Pipeline schedule timing (autodist/pipeline_time.py) against hand computations, and the planner's
use of it for a plan with more stages than device groups (interleaved)."""

import pytest

from nnscaler import ComputeConfig
from nnscaler.graph.capture import capture
from nnscaler.policies.autodist import planner_setup
from nnscaler.policies.autodist.evaluate import evaluate_nodes
from nnscaler.policies.autodist.layers import layer_instances
from nnscaler.policies.autodist.pipeline_time import (
    StageSplit,
    device_of_stage,
    pipeline_timing,
    stages_per_device,
)
from nnscaler.policies.autodist.step_time import stage_memory
from tests.zoo import build_llama


def test_1f1b_is_m_plus_p_minus_1_slowest_stages():
    # 4 stages of 3 s, the third 4 s, 8 micro-batches, 0.1 s hops: (8 + 3) x 4 + 2 x 3 x 0.1
    t = pipeline_timing("1f1b", [3.0, 3.0, 4.0, 3.0], 4, 8, hop=0.1)
    assert t.busy == pytest.approx(32.0)
    assert t.bubble == pytest.approx(12.0)
    assert t.hops == pytest.approx(0.6)
    assert t.step == pytest.approx(44.6)
    assert t.inflight == (4.0, 3.0, 2.0, 1.0)


def test_interleaved_bubble_shrinks_by_the_chunks_per_device():
    # 16 stages of 1 s over 4 devices (v = 4): each device 4 s per micro-batch; bubble (4 - 1) x 4 / 4 = 3 s
    t = pipeline_timing("1f1b_interleaved", [1.0] * 16, 4, 8)
    assert t.busy == pytest.approx(32.0)
    assert t.bubble == pytest.approx(3.0)
    plain = pipeline_timing("1f1b", [4.0] * 4, 4, 8)
    assert plain.bubble == pytest.approx(12.0)  # a quarter of it
    # Megatron's warm-up: device 0 keeps 2 (p - 1) + (v - 1) p + 1 = 19 chunks of 1/4
    assert t.inflight[0] == pytest.approx(19 / 4)
    assert t.inflight[3] == pytest.approx((0 + 12 + 1) / 4)


def test_interleaved_hops_count_every_stage_boundary():
    t = pipeline_timing("1f1b_interleaved", [1.0] * 8, 4, 8, hop=0.5)
    assert t.hops == pytest.approx(2 * 7 * 0.5)


def test_zero_bubble_schedules_against_the_papers_formulas():
    # F = B = W = 1 s per micro-batch on each of 4 devices
    zb = pipeline_timing("zb_h1", [3.0] * 4, 4, 8, as_run=False)
    assert zb.bubble == pytest.approx(3 * (1 + 1 - 1))  # (p - 1)(F + B - W)
    assert zb.inflight == (4.0, 3.0, 2.0, 1.0)  # 1F1B's memory
    # zbv: two stages per device in a V, F = B = W: no bubble
    v = pipeline_timing("zbv", [1.5] * 8, 4, 8, as_run=False)
    assert v.busy == pytest.approx(24.0) and v.bubble == pytest.approx(0.0)
    # with recompute (F:B:W = 1:2:1 of 4 s): (p - 1)(F + B - 2W) / 2 = 3 x (1 + 2 - 2) / 2
    rc = pipeline_timing("zbv", [2.0] * 8, 4, 8, split=StageSplit.for_recompute(True), as_run=False)
    assert rc.bubble == pytest.approx(1.5)
    # dualpipev, p = 8, chunks F = B = W = 0.5: (p/2 - 1)(F&B + B - 3W) = 3 x (1 + 0.5 - 1.5) = 0
    d = pipeline_timing("dualpipev", [1.5] * 16, 8, 16, as_run=False)
    assert d.bubble == pytest.approx(0.0) and d.inflight == (9.0,) * 8
    # ordering at equal stage times: 1F1B > ZB-H1 > ZB-V
    one = pipeline_timing("1f1b", [3.0] * 4, 4, 8)
    assert one.step > zb.step > pipeline_timing("zbv", [1.5] * 8, 4, 8, as_run=False).step


def test_zero_bubble_priced_as_the_runtime_orders_run():
    """By hand, zb_h1 on 2 devices, 2 micro-batches, F = B = W = 1 s. The runtime's orders: device 0
    F0 F1 B0 W0 B1 W1, device 1 F0 B0 W0 F1 B1 W1. Device 1: F0 [1, 2], B0 [2, 3], W0 [3, 4], F1 [4, 5],
    B1 [5, 6], W1 [6, 7]; device 0: F0 [0, 1], F1 [1, 2], B0 waits for device 1's B0: [3, 4], W0 [4, 5],
    B1 waits: [6, 7], W1 [7, 8]. Step 8 s for 6 s of work: a 2 s bubble, (p - 1)(F + B) (1F1B: 3 s, the
    paper's ZB-H1: 1 s)."""
    zb = pipeline_timing("zb_h1", [3.0, 3.0], 2, 2)
    assert (zb.busy, zb.bubble, zb.step) == pytest.approx((6.0, 2.0, 8.0))
    assert pipeline_timing("1f1b", [3.0, 3.0], 2, 2).bubble == pytest.approx(3.0)
    # the cycle repeats past 2 x stages micro-batches: the same bubble at 8 and 64
    assert pipeline_timing("zb_h1", [3.0] * 4, 4, 8).bubble == pytest.approx(
        pipeline_timing("zb_h1", [3.0] * 4, 4, 64).bubble
    )
    # the V's fill and drain, which the steady-state formula leaves out, are priced: more than 0, less
    # than ZB-H1's
    v = pipeline_timing("zbv", [1.5] * 8, 4, 8)
    assert 0.0 < v.bubble < pipeline_timing("zb_h1", [3.0] * 4, 4, 8).bubble


def test_v_shape_maps_stage_s_and_its_mirror_to_one_device():
    assert [device_of_stage("zbv", s, 4) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [device_of_stage("1f1b_interleaved", s, 4) for s in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_stage_counts_the_schedule_cannot_run_are_refused():
    with pytest.raises(ValueError, match="2 stages per device"):
        stages_per_device("zbv", 4, 4)
    with pytest.raises(ValueError, match="one stage per device"):
        stages_per_device("1f1b", 8, 4)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        pipeline_timing("1f2b", [1.0], 1, 1)


def test_stage_memory_adds_the_stages_of_a_device():
    # 4 stages over 2 devices interleaved, 4 micro-batches: device 0 holds stages 0 and 2
    mem = stage_memory([10.0, 20.0, 30.0, 40.0], [1.0, 2.0, 3.0, 4.0], "1f1b_interleaved", 2, 4)
    keep0 = (2 * 1 + 1 * 2 + 1) / 2
    keep1 = (0 + 2 + 1) / 2
    assert mem == [pytest.approx(40 + 4 * keep0), pytest.approx(60 + 6 * keep1)]
    # 1F1B: the old rule, min(pp - s, nmicros)
    assert stage_memory([1.0, 1.0], [2.0, 2.0], "1f1b", 2, 1) == [3.0, 3.0]


def test_evaluate_prices_an_interleaved_plan_below_its_1f1b_twin():
    """A 4-layer Llama over 2 pipeline groups: 4 stages interleaved (one layer each) idle less than 2 plain
    stages of two layers on the same devices, and keep more activations on device 0."""
    model, make_batch = build_llama(num_hidden_layers=4)
    graph = capture(model, make_batch(0, 4), both_modes=False)
    setup = planner_setup(graph, ComputeConfig(2, 2, use_end2end=True, pas_config={"cluster": "cpu_gloo"}))
    _, instances = layer_instances(graph, None)
    firsts = [idx[0] for _, idx in instances]
    assert len(firsts) == 4
    plain = evaluate_nodes(graph, setup, {}, pp=2, starts=[0, firsts[2]], nmicros=4)
    inter = evaluate_nodes(
        graph, setup, {}, pp=2, starts=[0, *firsts[1:]], nmicros=4, scheduler="1f1b_interleaved"
    )
    assert len(inter.stage_times) == 4 and len(plain.stage_times) == 2
    bubble_plain = plain.step_time - 4 * max(plain.stage_times)
    bubble_inter = inter.step_time - 4 * max(
        inter.stage_times[0] + inter.stage_times[2], inter.stage_times[1] + inter.stage_times[3]
    )
    assert bubble_inter < bubble_plain
    assert inter.memory > plain.memory
