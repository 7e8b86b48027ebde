"""Every pipeline schedule's P2P program under the NCCL model (rendezvous sends, one ordered stream
per rank pair, batched groups): the executor's agreed order never hangs; the old unpaired order
(send when made, receive just before use) hangs for every 1F1B with more than one micro-batch."""

from __future__ import annotations

import pytest

from nnscaler.codegen.schedule_code import pipeline_train_lines
from nnscaler.errors import PlanError
from nnscaler.policies import nccl_sim
from nnscaler.policies.nccl_sim import Batch, check_nccl, simulate_nccl
from nnscaler.policies.p2p_plan import (
    Compute,
    Message,
    Post,
    Send,
    Wait,
    group_program,
    messages_of,
    pair_sequences,
    unpaired_program,
)
from nnscaler.policies.schedules import Action


def _combos():
    """(scheduler, nstages, pp_size, nmicros): 2..6 device groups, 1..8 micro-batches, 2-3 chunks."""
    for pp in range(2, 7):
        for m in range(1, 9):
            yield "gpipe", pp, pp, m
            yield "1f1b", pp, pp, m
            if m % pp == 0:
                for chunks in (1, 2, 3):
                    yield "1f1b_interleaved", pp * chunks, pp, m


def _hangs(make, scheduler, nstages, pp, m, train) -> bool:
    try:
        simulate_nccl([make(scheduler, nstages, pp, m, g, train) for g in range(pp)])
    except PlanError:
        return True
    return False


def test_no_schedule_hangs_with_the_agreed_order_and_the_unpaired_order_does():
    old: dict[tuple[str, bool], int] = {}
    total = 0
    for scheduler, nstages, pp, m in _combos():
        for train in (True, False):
            total += 1
            assert not _hangs(group_program, scheduler, nstages, pp, m, train), (
                scheduler,
                nstages,
                pp,
                m,
                train,
            )
            hung = _hangs(unpaired_program, scheduler, nstages, pp, m, train)
            if hung:
                old[scheduler, train] = old.get((scheduler, train), 0) + 1
            if scheduler == "1f1b" and train:
                assert hung == (m > 1), (nstages, m)
            if scheduler == "gpipe":
                assert not hung, (nstages, m, train)
    print(f"{total} programs; agreed order: 0 hang; unpaired order hangs: {old}")
    assert old[("1f1b_interleaved", True)] > 0


def test_unpaired_1f1b_with_two_stages_hangs_on_the_pair_stream():
    programs = [unpaired_program("1f1b", 2, 2, 2, g) for g in range(2)]
    with pytest.raises(PlanError, match="deadlock under NCCL semantics") as info:
        simulate_nccl(programs)
    # rank 0: [send F1, recv B0]; rank 1: [send B0, recv F1] -- each send waits behind the other's
    assert "at op 1 of the pair, group 0 sends [send activations of stage 0 micro-batch 1]" in str(info.value)
    assert "group 1 sends [send gradients of stage 1 micro-batch 0]" in str(info.value)


def test_megatron_batched_pairs_run():
    """send_forward_recv_backward / send_backward_recv_forward as batch_isend_irecv groups."""
    f0, f1, b0, b1 = (Message(k, s, m) for k, s, m in [("F", 0, 0), ("F", 0, 1), ("B", 1, 0), ("B", 1, 1)])
    rank0 = [
        Compute(Action("F", 0, 0)),
        Send(f0, 1),
        Compute(Action("F", 0, 1)),
        Batch((Send(f1, 1), Post(b0, 1))),
        Wait(b0, 1),
        Compute(Action("B", 0, 0)),
        Post(b1, 1),
        Wait(b1, 1),
        Compute(Action("B", 0, 1)),
    ]
    rank1 = [
        Post(f0, 0),
        Wait(f0, 0),
        Compute(Action("F", 1, 0)),
        Compute(Action("B", 1, 0)),
        Batch((Send(b0, 0), Post(f1, 0))),
        Wait(f1, 0),
        Compute(Action("F", 1, 1)),
        Compute(Action("B", 1, 1)),
        Send(b1, 0),
    ]
    simulate_nccl([rank0, rank1])
    # the same batch against unbatched ops on the other side does not match
    with pytest.raises(PlanError, match="order mismatch between device groups 0 and 1 at op 1"):
        simulate_nccl(
            [rank0, [s for s in rank1 if not isinstance(s, Batch)][:4] + [Send(b0, 0), Post(f1, 0)]]
        )


def test_swapped_messages_of_equal_kind_are_a_mismatch():
    f0, f1 = Message("F", 0, 0), Message("F", 0, 1)
    rank0 = [Send(f0, 1), Send(f1, 1)]
    rank1 = [Post(f1, 0), Post(f0, 0), Wait(f0, 0), Wait(f1, 0)]
    with pytest.raises(
        PlanError, match="at op 0: group 0 issues \\[send activations of stage 0 micro-batch 0\\]"
    ):
        simulate_nccl([rank0, rank1])


def test_both_sides_issue_the_agreed_pair_order():
    seqs = pair_sequences("1f1b_interleaved", 8, 4, 8)
    for (a, b), seq in seqs.items():
        on_a = [
            m for m in messages_of(group_program("1f1b_interleaved", 8, 4, 8, a)) if b in (m.src(4), m.dst(4))
        ]
        on_b = [
            m for m in messages_of(group_program("1f1b_interleaved", 8, 4, 8, b)) if a in (m.src(4), m.dst(4))
        ]
        assert on_a == on_b == seq


def test_plan_time_check_names_the_schedule(monkeypatch):
    check_nccl("1f1b", 4, 4, 8)  # the executor's order passes
    monkeypatch.setattr(nccl_sim, "group_program", unpaired_program)
    with pytest.raises(
        PlanError, match="schedule '1f1b' with 2 stages on 2 device groups and 4 micro-batches would hang"
    ):
        check_nccl("1f1b", 2, 2, 4)


def test_generated_code_posts_receives_in_the_pair_order():
    lines = pipeline_train_lines("1f1b", 2, 2, 3, 1, lambda s: s)
    posts = [i for i, line in enumerate(lines) if line.startswith("pipe.post_recv_forward")]
    send_b0 = lines.index("pipe.send_backward(a.pop((1, 0)), 1, 0, dst=0)  # to stage 0")
    # F0 and F1 are posted before rank 1 sends B0 (rank 0 sends F1 first), F2 right after it
    assert lines[posts[0]].startswith("pipe.post_recv_forward(1, 0, src=0)")
    assert lines[posts[1]].startswith("pipe.post_recv_forward(1, 1, src=0)") and posts[1] < send_b0
    assert lines[posts[2]].startswith("pipe.post_recv_forward(1, 2, src=0)") and posts[2] == send_b0 + 1


def test_generated_code_names_its_peers_to_connect_first():
    """Interleaved group 0's first op is a receive from the last group: pairs are connected first."""
    lines = pipeline_train_lines("1f1b_interleaved", 8, 4, 4, 0, lambda s: s % 4)
    assert lines[0].endswith("peers=[1, 3])")
    assert lines[4] == "pipe.post_recv_forward(4, 0, src=3)  # posted early: P2P order"
