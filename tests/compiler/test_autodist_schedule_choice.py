"""autodist picks the pipeline schedule: each schedule the runtime runs is costed on its stage cut, the
fastest that fits the memory limit is taken, the others carry why not, and the report says so."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nnscaler import ComputeConfig
from nnscaler.errors import PlanError
from nnscaler.policies import make_plan
from nnscaler.policies.autodist import planner_setup, search
from nnscaler.policies.autodist.context import stage_context, transient_bytes
from nnscaler.policies.autodist.pipeline_time import pipeline_timing
from nnscaler.policies.autodist.policy import plan_from_candidate
from nnscaler.policies.autodist.report import plan_report
from nnscaler.policies.autodist.schedule_choice import (
    ScheduleOption,
    pick_schedule,
    schedule_runs,
    searched_schedules,
    stage_counts,
)
from nnscaler.policies.plan import SCHEDULERS


def _e2e(**pas) -> ComputeConfig:
    return ComputeConfig(2, 2, use_end2end=True, pas_config={"cluster": "cpu_gloo", **pas})


def test_pick_takes_the_fastest_that_fits():
    opts = [
        ScheduleOption("1f1b", 5.0, 10.0, 0.2, 2, True),
        ScheduleOption("1f1b_interleaved", 4.5, 12.0, 0.1, 4, True),
        ScheduleOption("zbv", 4.0, 20.0, 0.05, 4, False, "needs 20 GB, over the limit"),
        ScheduleOption("dualpipev", 0.0, 0.0, 0.0, 4, False, "cannot run: nmicros"),
    ]
    best, costed = pick_schedule(opts)
    assert best.scheduler == "1f1b_interleaved"
    why = {o.scheduler: o.why_not for o in costed}
    assert why["1f1b_interleaved"] == ""
    assert why["1f1b"].startswith("500.000 ms slower")  # (5.0 - 4.5) s
    assert "over the limit" in why["zbv"] and why["dualpipev"].startswith("cannot run")
    assert pick_schedule(opts[2:])[0] is None  # nothing fits: no candidate
    tie = [ScheduleOption("1f1b", 4.0, 1.0, 0.2, 2, True), ScheduleOption("zb_h1", 4.0, 1.0, 0.1, 2, True)]
    assert pick_schedule(tie)[0].scheduler == "1f1b"  # a tie keeps the simpler schedule


def test_searched_schedules_are_those_the_runtime_runs():
    auto = searched_schedules("auto")
    assert "gpipe" not in auto and "1f1b" in auto and "1f1b_interleaved" in auto
    assert set(auto) <= set(SCHEDULERS)
    assert searched_schedules("gpipe") == ("gpipe",)
    assert stage_counts(("1f1b", "1f1b_interleaved", "zbv"), 3) == {
        3: ("1f1b",),
        6: ("1f1b_interleaved", "zbv"),
    }
    assert "multiple" in schedule_runs("1f1b_interleaved", 4, 2, 3)  # interleaved: nmicros % pp
    assert schedule_runs("1f1b", 2, 2, 3) is None


def _pipelined(scored):
    return [c for c in scored if c.pp == 2 and c.schedule_options]


def test_auto_costs_every_schedule_and_takes_the_fastest(zoo_graphs):
    graph = zoo_graphs["llama"][0]
    setup = planner_setup(graph, _e2e(pipeline_nmicros=4))
    assert setup.schedulers == searched_schedules("auto")
    _, scored = search(graph, setup)
    pipes = _pipelined(scored)
    assert pipes
    for cand in pipes:
        names = {o.scheduler for o in cand.schedule_options}
        assert {"1f1b", "1f1b_interleaved"} <= names
        fitting = [o for o in cand.schedule_options if o.fits]
        taken = min(fitting, key=lambda o: o.step)
        assert (cand.scheduler, len(cand.starts), cand.step_time) == (
            taken.scheduler,
            taken.nstages,
            taken.step,
        )
        for o in fitting:  # the bubble by hand: (p - 1) T / v on the slowest device, T = its stages' time
            if o.scheduler == "1f1b" and o is taken:
                t = max(cand.stage_times)
                assert cand.step_time >= (4 + 1) * t
    # the interleaved option's bubble halves 1F1B's for the same per-device time (hand: (p-1)T/v)
    one, two = pipeline_timing("1f1b", [1.0, 1.0], 2, 4), pipeline_timing("1f1b_interleaved", [0.5] * 4, 2, 4)
    assert (one.bubble, two.bubble) == (1.0, 0.5)


def test_memory_limit_rejects_the_schedule_that_keeps_more(zoo_graphs):
    graph = zoo_graphs["llama"][0]
    setup = planner_setup(graph, _e2e(pipeline_nmicros=4))
    _, scored = search(graph, setup)
    cand = min(_pipelined(scored), key=lambda c: c.memory)
    mem = {o.scheduler: o.memory for o in cand.schedule_options if o.fits}
    assert mem["1f1b_interleaved"] > mem["1f1b"]  # its warm-up keeps more micro-batches on device 0
    transient = transient_bytes(graph, stage_context(setup, cand.tp, pipelined=True), setup)
    limit = transient + (mem["1f1b"] + mem["1f1b_interleaved"]) / 2
    _, again = search(graph, replace(setup, mem_limit=limit))
    same = [c for c in _pipelined(again) if (c.tp, c.recompute, c.nmicros) == (cand.tp, cand.recompute, 4)]
    assert same
    for c in same:
        fits = [o for o in c.schedule_options if o.memory <= limit - transient and o.step > 0]
        assert c.scheduler == min(fits, key=lambda o: o.step).scheduler and c.memory <= limit - transient
        inter = next(o for o in c.schedule_options if o.scheduler == "1f1b_interleaved")
        assert not inter.fits and "over the limit" in inter.why_not


def test_pinned_schedule_is_the_only_one_costed_and_the_report_says_why(zoo_graphs):
    graph = zoo_graphs["llama"][0]
    setup = planner_setup(graph, _e2e(pipeline_nmicros=4, pipeline_scheduler="1f1b_interleaved"))
    _, scored = search(graph, setup)
    assert _pipelined(scored)
    for c in _pipelined(scored):  # 4 stages on 2 device groups, no other schedule costed
        assert {o.scheduler for o in c.schedule_options} == {"1f1b_interleaved"} and len(c.starts) == 4
    plan = make_plan(
        graph, "autodist", _e2e(pipeline_nstages=2, pipeline_nmicros=4, pipeline_scheduler="1f1b")
    )
    assert (plan.pipeline.nstages, plan.pipeline.scheduler) == (2, "1f1b")
    setup = planner_setup(graph, _e2e(pipeline_nmicros=4))
    best, scored = search(graph, setup)
    pipes = sorted(_pipelined(scored), key=lambda c: c.time_per_micro)
    text = plan_report(graph, plan_from_candidate(graph, pipes[0], setup), setup, scored, recipes=False)
    assert "## Pipeline schedule" in text and f"Chosen: {pipes[0].scheduler}" in text
    assert "slower (bubble" in text  # the other schedule's reason


@pytest.mark.parametrize("nmicros", [3])
def test_interleaving_is_not_offered_where_it_cannot_run(zoo_graphs, nmicros):
    graph = zoo_graphs["llama"][0]
    _, scored = search(graph, planner_setup(graph, _e2e(pipeline_nmicros=nmicros)))
    for c in _pipelined(scored):
        inter = next(o for o in c.schedule_options if o.scheduler == "1f1b_interleaved")
        assert not inter.fits and inter.why_not.startswith("cannot run") and c.scheduler != inter.scheduler


ZERO_BUBBLE = ("zb_h1", "zbv", "dualpipev")


def test_zero_bubble_is_chosen_where_faster_and_not_where_memory_forbids(zoo_graphs):
    graph = zoo_graphs["llama"][0]
    setup = planner_setup(graph, _e2e(pipeline_nmicros=4))
    _, scored = search(graph, setup)
    cand = next(c for c in _pipelined(scored) if not c.recompute)
    step = {o.scheduler: o.step for o in cand.schedule_options}
    mem = {o.scheduler: o.memory for o in cand.schedule_options}
    assert cand.scheduler in ZERO_BUBBLE and step[cand.scheduler] < step["1f1b"]
    assert mem["zb_h1"] == mem["1f1b"]  # ZB-H1 keeps 1F1B's micro-batches in flight
    assert cand.scheduler == "zbv" and mem["zbv"] > mem["zb_h1"]  # the V keeps p on every device
    transient = transient_bytes(graph, stage_context(setup, cand.tp, pipelined=True), setup)
    tight = replace(setup, mem_limit=transient + (mem["zb_h1"] + mem["zbv"]) / 2)
    _, again = search(graph, tight)
    same = next(c for c in _pipelined(again) if (c.tp, c.recompute) == (cand.tp, False))
    why = {o.scheduler: o.why_not for o in same.schedule_options}
    assert same.scheduler == "zb_h1" and "over the limit" in why["zbv"]


def test_a_pinned_schedule_that_cannot_run_says_why_not_memory():
    from nnscaler.graph.capture import capture
    from tests import zoo

    model, make_batch = zoo.build("llama_deep")
    graph = capture(model, make_batch(1, 4))
    cfg = _e2e(pipeline_nstages=4, pipeline_nmicros=2, pipeline_scheduler="dualpipev")
    with pytest.raises(
        PlanError, match=r"dualpipev with 2 micro-batches cannot run: .*micro-batches as stages"
    ) as err:
        make_plan(graph, "autodist", cfg)
    assert "mem_constraint" not in str(err.value)
