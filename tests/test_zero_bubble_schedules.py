"""Zero-bubble schedules without processes (issue 44): every zb_h1 / zbv / dualpipev order runs each
stage's F and B once (W at most once, after its B) on the stage's device group, never deadlocks, passes
the NCCL model, idles less than 1F1B; a misordered one is refused; the generated `_train_step` splits
the backward into B and W calls; the `pp` policy takes the names."""

from __future__ import annotations

import pytest

from nnscaler import ComputeConfig
from nnscaler.codegen.schedule_code import pipeline_train_lines
from nnscaler.errors import PlanError
from nnscaler.graph.capture import capture
from nnscaler.policies import make_plan, nccl_sim, schedules
from nnscaler.policies.nccl_sim import check_nccl
from nnscaler.policies.p2p_plan import Compute, Post, Send, Wait, group_program, pair_sequences
from nnscaler.policies.pipeline_actions import Action, stage_group
from nnscaler.policies.schedules import group_actions, simulate, theoretical_bubble
from tests import zoo

ZB = ("zb_h1", "zbv", "dualpipev")


def _nstages(scheduler: str, pp: int) -> int:
    return pp if scheduler == "zb_h1" else 2 * pp


def _combos():
    for pp in (2, 3, 4, 5):
        for m in range(1, 13):
            for scheduler in ZB:
                if scheduler != "dualpipev" or m >= 2 * pp:
                    yield scheduler, _nstages(scheduler, pp), pp, m


def test_v_places_stage_s_and_its_mirror_on_one_group():
    assert [stage_group("zbv", s, 4) for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert [stage_group("dualpipev", s, 2) for s in range(4)] == [0, 1, 1, 0]
    assert [stage_group("zb_h1", s, 4) for s in range(4)] == [0, 1, 2, 3]


def test_every_zero_bubble_schedule_runs_and_passes_the_nccl_model():
    count = 0
    for scheduler, nstages, pp, m in _combos():
        timing = simulate(scheduler, nstages, pp, m)  # checks passes, groups, order; raises on deadlock
        assert timing.makespan > 0
        check_nccl(scheduler, nstages, pp, m)
        orders = [group_actions(scheduler, nstages, pp, m, g) for g in range(pp)]
        ws = [a for o in orders for a in o if a.kind == "W"]
        assert ws, (scheduler, pp, m)  # the backward is split somewhere
        count += 1
    assert count > 100


@pytest.mark.parametrize("pp", [2, 4])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_zero_bubble_idles_less_than_1f1b(pp, m):
    plain = max(simulate("1f1b", pp, pp, m).idle_fraction)
    for scheduler in ZB:
        if scheduler == "dualpipev" and m < 2 * pp:
            continue
        idle = max(simulate(scheduler, _nstages(scheduler, pp), pp, m).idle_fraction)
        assert idle < plain, (scheduler, idle, plain)
        assert theoretical_bubble(scheduler, _nstages(scheduler, pp), pp, m) == pytest.approx(idle)


def test_zb_h1_keeps_the_memory_of_1f1b():
    """Stage s holds at most p - s micro-batches between their forward and their W, as 1F1B does."""
    for m in (4, 8, 12):
        for g in range(4):
            live = peak = 0
            for a in group_actions("zb_h1", 4, 4, m, g):
                live += {"F": 1, "W": -1}.get(a.kind, 0)
                peak = max(peak, live)
            assert peak <= min(4 - g, m)


def test_shape_and_micro_batch_constraints_are_named():
    with pytest.raises(PlanError, match="exactly two stages per device group"):
        group_actions("zbv", 4, 4, 8, 0)
    with pytest.raises(PlanError, match="one stage per device group"):
        group_actions("zb_h1", 8, 4, 8, 0)
    with pytest.raises(PlanError, match="at least as many micro-batches as stages"):
        group_actions("dualpipev", 8, 4, 4, 0)


def test_a_misordered_schedule_is_refused(monkeypatch):
    real = schedules.group_actions

    def w_before_b(scheduler, nstages, pp, m, group):
        out = real(scheduler, nstages, pp, m, group)
        i = out.index(Action("B", 0, 0)) if group == 0 else None
        if i is not None:
            out.insert(i, out.pop(out.index(Action("W", 0, 0))))
        return out

    monkeypatch.setattr(schedules, "group_actions", w_before_b)
    with pytest.raises(PlanError, match="before its backward 'B'"):
        schedules.simulate("zbv", 4, 2, 4)

    def swapped_forwards(scheduler, nstages, pp, m, group):
        """Group 1 runs stage 2's forward of micro-batch 0 before stage 1's, whose outputs it needs."""
        out = real(scheduler, nstages, pp, m, group)
        if group == 1:
            i, j = out.index(Action("F", 2, 0)), out.index(Action("F", 1, 0))
            out[i], out[j] = out[j], out[i]
        return out

    monkeypatch.setattr(schedules, "group_actions", swapped_forwards)
    with pytest.raises(PlanError, match="deadlocks"):
        schedules.simulate("zbv", 4, 2, 4)


def test_a_misordered_p2p_program_hangs_under_the_nccl_model(monkeypatch):
    """Group 1 of zb_h1 posts its receives only right before use: its first gradient send meets group 0's
    second activation send, both waiting for a receive (NCCL's rendezvous sends hang there)."""
    pair_sequences.cache_clear()
    real = group_program

    def late_posts(scheduler, nstages, pp, m, group, train=True):
        steps = real(scheduler, nstages, pp, m, group, train)
        if group != 1 or not train:
            return steps
        posts = {s.msg: s for s in steps if isinstance(s, Post)}
        out = []
        for s in steps:
            if isinstance(s, Post):
                continue
            if isinstance(s, Wait):
                out.append(posts[s.msg])
            out.append(s)
        return out

    monkeypatch.setattr(nccl_sim, "group_program", late_posts)
    with pytest.raises(
        PlanError, match="'zb_h1' with 2 stages on 2 device groups and 4 micro-batches would hang"
    ):
        check_nccl("zb_h1", 2, 2, 4)


def test_train_step_splits_the_backward():
    rank_of = {0: 0, 1: 1, 2: 1, 3: 0}.__getitem__
    lines = pipeline_train_lines("zbv", 4, 2, 4, 0, rank_of)
    text = "\n".join(lines)
    assert "reduce_stage=0" in lines[0]  # rank 0 runs stages 0 and 3: stage 0 finishes the gradients
    assert "pipe.backward_loss_inputs(y.pop((3, 0)), a[3, 0], 3, 0)" in text
    assert "pipe.backward_inputs(y.pop((0, 0)), g, (), 0, 0)" in text
    assert "pipe.backward_weights(0, 3)" in text
    # stage 3's inputs come from stage 2 on rank 1; stage 0's outputs go there
    assert "pipe.recv_forward(3, 0, src=1)" in text and "pipe.send_forward(y[0, 0], 0, 0, dst=1)" in text
    steps = group_program("zbv", 4, 2, 4, 0)
    assert sum(isinstance(s, Compute) and s.action.kind == "W" for s in steps) == 8
    assert all(s.peer == 1 for s in steps if isinstance(s, (Post, Send)))
    plain = "\n".join(pipeline_train_lines("1f1b", 2, 2, 4, 0, [0, 1].__getitem__))
    assert "backward_weights" not in plain and "reduce_stage" not in plain


def test_pp_and_hybrid_policies_build_a_v_for_zbv():
    model, make_batch = zoo.build("gpt_deep")
    graph = capture(model, make_batch(1, 2))
    for scheduler, nstages in (("zbv", 4), ("dualpipev", 4), ("zb_h1", 2)):
        cfg = ComputeConfig(
            2, 2, use_end2end=True, pas_config={"pipeline_nmicros": 4, "pipeline_scheduler": scheduler}
        )
        plan = make_plan(graph, "pp", cfg)
        pipe = plan.pipeline
        assert (pipe.scheduler, pipe.nstages, pipe.pp_size) == (scheduler, nstages, 2)
    # hybrid: two stages per device group by default for the V shapes (tp 2 inside each stage here)
    pas = {"pipeline_nmicros": 4, "pipeline_scheduler": "zbv", "pp_size": 2}
    plan = make_plan(graph, "hybrid", ComputeConfig(4, 4, use_end2end=True, pas_config=pas))
    assert (plan.pipeline.nstages, plan.pipeline.pp_size) == (4, 2)
