"""register_op: a custom op and a plain function trace as one node each, split per annotation, and
are called by name in the generated code; training matches one device."""

from __future__ import annotations

import pytest
import torch

from nnscaler import ComputeConfig
from nnscaler.graph.capture import capture
from nnscaler.graph.ir import Shard
from nnscaler.partition import apply_plan
from nnscaler.policies import make_plan
from tests import zoo
from tests.parity import run_parity


def test_user_ops_trace_as_single_nodes_and_split():
    model, make_batch = zoo.build("userops")
    graph = capture(model, make_batch(0, 4))
    ops = [n.op for n in graph.nodes]
    assert "nnscaler_user.swiglu.default" in ops and "nntest.scaled_tanh.default" in ops
    assert "aten.silu.default" not in ops, "the plain function must be one node, not its body"
    plan = make_plan(graph, "tp", ComputeConfig(2, 2))
    program = apply_plan(graph, plan)
    for node in graph.nodes:
        if node.op in ("nnscaler_user.swiglu.default", "nntest.scaled_tanh.default"):
            assert plan.node(node.name).split == "h"
            assert program.layouts[node.outputs[0]] == Shard(1)


@pytest.mark.parametrize("policy,plan_ngpus,runtime_ngpus", [("dp", 1, 2), ("tp", 2, 2)])
def test_user_ops_parity(policy, plan_ngpus, runtime_ngpus, tmp_path):
    run_parity("userops", policy, plan_ngpus, runtime_ngpus, tmp_path=tmp_path)
    code = next(tmp_path.glob("**/gencode0.py")).read_text()
    assert "torch.ops.nnscaler_user.swiglu.default(" in code
    assert "torch.ops.nntest.scaled_tanh.default(" in code
    assert "import tests.user_ops" in code


def test_emit_fn_writes_each_ranks_call(tmp_path):
    """nnScaler's emit_fn: the generated call is the function's code, per rank; training still
    matches one device (tp 2 x dp 2: the op checks it runs on the rank its call was written for)."""
    run_parity("emitops", "tp", 2, 4, tmp_path=tmp_path)
    for rank in range(4):
        code = next(tmp_path.glob(f"**/gencode{rank}.py")).read_text()
        assert "torch.ops.nnscaler_user.rank_checked_mul.default(" in code
        assert f"rank={rank}, nranks=4)" in code


def test_emit_fn_must_write_an_expression():
    import nnscaler
    from nnscaler.codegen.expr import Formatter, op_expression
    from nnscaler.partition import Statement

    @nnscaler.register_op("* h -> * h", name="bad_emit_op", emit_fn=lambda *a: "not valid python(")
    def bad_emit_op(x: torch.Tensor) -> torch.Tensor:
        return x

    s = Statement("op", "nnscaler_user.bad_emit_op.default", (), {}, ["y"])
    with pytest.raises(SyntaxError, match="bad_emit_op.default returned code that is not an expression"):
        op_expression(s, Formatter(0, set()))


def test_register_op_rejects_main_functions():
    import nnscaler

    def f(x):
        return x

    f.__module__ = "__main__"
    with pytest.raises(ValueError, match="importable module"):
        nnscaler.register_op("* -> *")(f)


def test_register_op_rejects_bad_annotation():
    import nnscaler
    from nnscaler.graph.ops import AnnotationError

    with pytest.raises(AnnotationError):
        nnscaler.register_op("a b")
