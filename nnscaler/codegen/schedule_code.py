"""The body of a rank's `_train_step` / `_infer_step`: its schedule written out, one call per line."""

from __future__ import annotations

from collections.abc import Callable

from nnscaler.policies.p2p_plan import Compute, Post, Send, group_program
from nnscaler.policies.pipeline_actions import V_SHAPED
from nnscaler.policies.schedules import Action

__all__ = ["pipeline_train_lines", "pipeline_infer_lines", "plain_train_lines", "plain_infer_lines"]


def _forward_lines(a: Action, nstages: int, rank_of: Callable[[int], int], keep: bool = True) -> list[str]:
    """keep: store inputs and outputs under (stage, micro-batch) for the backward."""
    s, m = a.stage, a.micro
    act, out = (f"a[{s}, {m}]", f"y[{s}, {m}]") if keep else ("a", "y")
    lines = [f"# forward: stage {s}, micro-batch {m}"]
    if s > 0:
        lines.append(f"{act} = pipe.recv_forward({s}, {m}, src={rank_of(s - 1)})  # stage {s - 1}'s outputs")
        lines.append(f"{out} = model.stage{s}(x[{m}], *{act})")
    else:
        lines.append(f"{out} = model.stage{s}(x[{m}])")
    if s + 1 < nstages:
        here = " (on this rank: handed over in memory)" if rank_of(s + 1) == rank_of(s) else ""
        lines.append(f"pipe.send_forward({out}, {s}, {m}, dst={rank_of(s + 1)})  # to stage {s + 1}{here}")
    else:
        lines.append(f"pipe.loss({out}, {m})")
    return lines


def _backward_lines(
    a: Action, nstages: int, rank_of: Callable[[int], int], split: bool = False, tag: bool = False
) -> list[str]:
    """split: input gradients only (B); the weights' come in this stage's W later (zero-bubble).
    tag: name the stage (a rank of a V runs two; only one of them launches gradient reductions)."""
    s, m = a.stage, a.micro
    st = f", stage={s}" if tag else ""
    inputs = f"a[{s}, {m}]" if s > 0 else "()"
    lines = [f"# backward{' (input gradients)' if split else ''}: stage {s}, micro-batch {m}"]
    if s + 1 < nstages:
        lines.append(f"g = pipe.recv_backward({s}, {m}, src={rank_of(s + 1)})  # gradients of the outputs")
        if split:
            lines.append(f"pipe.backward_inputs(y.pop(({s}, {m})), g, {inputs}, {s}, {m})")
        else:
            lines.append(f"pipe.backward(y.pop(({s}, {m})), g, {m}{st})")
    elif split:
        lines.append(f"pipe.backward_loss_inputs(y.pop(({s}, {m})), {inputs}, {s}, {m})")
    else:
        lines.append(f"pipe.backward_loss(y.pop(({s}, {m})), {m}{st})")
    if s > 0:
        lines.append(
            f"pipe.send_backward(a.pop(({s}, {m})), {s}, {m}, dst={rank_of(s - 1)})  # to stage {s - 1}"
            + (" (on this rank: handed over in memory)" if rank_of(s - 1) == rank_of(s) else "")
        )
    return lines


def _prologue(train: bool, peers: list[int] | None = None, reduce_stage: int | None = None) -> list[str]:
    args = "train=True, scale_fn=scale_fn, is_dummy_batch=is_dummy_batch" if train else "train=False"
    args += f", peers={peers}" if peers else ""
    args += f", reduce_stage={reduce_stage}" if train and reduce_stage is not None else ""
    lines = [
        f"pipe = PipelineStep(model, samples, {args})",
        "x = pipe.inputs  # traced inputs and input sizes per micro-batch",
    ]
    if train:
        lines += [
            "a = {}  # (stage, micro-batch) -> activations received from the previous stage",
            "y = {}  # (stage, micro-batch) -> outputs, kept until their backward",
        ]
    return lines


def _post_line(step: Post, rank_of: Callable[[int], int]) -> str:
    """Post a receive early, in the P2P order agreed with the peer (nnscaler/policies/p2p_plan.py)."""
    msg = step.msg
    if msg.kind == "F":
        return f"pipe.post_recv_forward({msg.stage + 1}, {msg.micro}, src={rank_of(msg.stage)})  # posted early: P2P order"
    return f"pipe.post_recv_backward({msg.stage - 1}, {msg.micro}, src={rank_of(msg.stage)})  # posted early: P2P order"


def _peer_rank(step: Post | Send, rank_of: Callable[[int], int]) -> int:
    """The rank at the other end of a P2P op."""
    msg = step.msg
    if isinstance(step, Post):
        return rank_of(msg.stage)
    return rank_of(msg.stage + (1 if msg.kind == "F" else -1))


def _schedule_lines(
    scheduler: str,
    nstages: int,
    pp_size: int,
    nmicros: int,
    group: int,
    rank_of: Callable[[int], int],
    train: bool,
) -> list[str]:
    """Each forward / backward (its receive waited, its send issued) and the receives posted early."""
    program = group_program(scheduler, nstages, pp_size, nmicros, group, train)
    peers = sorted(
        {_peer_rank(s, rank_of) for s in program if isinstance(s, (Post, Send)) and s.peer != group}
    )
    mine = sorted({s.action.stage for s in program if isinstance(s, Compute)})
    tag = scheduler in V_SHAPED  # two stages here: the lower one finishes the weights' gradients last
    lines = _prologue(train, peers, mine[0] if tag and mine else None)
    split = {
        (s.action.stage, s.action.micro) for s in program if isinstance(s, Compute) and s.action.kind == "W"
    }
    for step in program:
        if isinstance(step, Post) and step.peer != group:
            lines.append(_post_line(step, rank_of))
        elif isinstance(step, Compute) and step.action.kind == "F":
            lines += _forward_lines(step.action, nstages, rank_of, keep=train)
        elif isinstance(step, Compute) and step.action.kind == "W":
            a = step.action
            lines += [f"# backward (weight gradients): stage {a.stage}, micro-batch {a.micro}"]
            lines += [f"pipe.backward_weights({a.stage}, {a.micro})"]
        elif isinstance(step, Compute):
            key = (step.action.stage, step.action.micro)
            lines += _backward_lines(step.action, nstages, rank_of, key in split, tag)
    return lines + ["return pipe.finish()"]


def pipeline_train_lines(
    scheduler: str, nstages: int, pp_size: int, nmicros: int, group: int, rank_of: Callable[[int], int]
) -> list[str]:
    return _schedule_lines(scheduler, nstages, pp_size, nmicros, group, rank_of, True)


def pipeline_infer_lines(
    scheduler: str, nstages: int, pp_size: int, nmicros: int, group: int, rank_of: Callable[[int], int]
) -> list[str]:
    return _schedule_lines(scheduler, nstages, pp_size, nmicros, group, rank_of, False)


def plain_train_lines() -> list[str]:
    return [
        "pipe = PipelineStep(model, samples, train=True, scale_fn=scale_fn, is_dummy_batch=is_dummy_batch)",
        "for micro, kwargs in enumerate(pipe.kwargs):",
        "    outputs = pytree.tree_leaves(model(**kwargs))",
        "    pipe.loss(outputs, micro)",
        "    pipe.backward_loss(outputs, micro)",
        "return pipe.finish()",
    ]


def plain_infer_lines() -> list[str]:
    return [
        "pipe = PipelineStep(model, samples, train=False)",
        "for micro, kwargs in enumerate(pipe.kwargs):",
        "    pipe.loss(pytree.tree_leaves(model(**kwargs)), micro)",
        "return pipe.finish()",
    ]
