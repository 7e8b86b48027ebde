"""nnScaler 0.8's `nnscaler.utils` helpers (its examples' logger level and per-rank print) and
`register_op` of a function without a return annotation (swin's `window_attn`)."""

from __future__ import annotations

import contextlib
import io
import logging

import pytest
import torch

import nnscaler.utils
from nnscaler import ComputeConfig
from nnscaler.errors import TraceError
from nnscaler.graph.capture import capture
from nnscaler.policies import make_plan
from tests import nnscaler08_ops
from tests.dist_util import spawn
from tests.parity import run_parity


@pytest.fixture
def restore_loggers():
    root, ours = logging.getLogger(), logging.getLogger("nnscaler")
    levels, handlers = (root.level, ours.level), list(root.handlers)
    yield
    root.setLevel(levels[0])
    ours.setLevel(levels[1])
    for h in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(h)


@pytest.mark.parametrize("level", [logging.INFO, "DEBUG"])
def test_set_default_logger_level_sets_nnscalers_loggers(level, restore_loggers):
    logging.getLogger("nnscaler").setLevel(logging.WARNING)
    nnscaler.utils.set_default_logger_level(level)
    want = logging.getLevelName(level) if isinstance(level, str) else level
    for name in ("nnscaler", "nnscaler.parallel", "nnscaler.cli.trainer"):
        assert logging.getLogger(name).getEffectiveLevel() == want, name
    assert logging.getLogger("nnscaler.parallel").isEnabledFor(logging.INFO)


def test_print_each_rank_in_one_process(capsys):
    nnscaler.utils.print_each_rank("hello")
    nnscaler.utils.print_each_rank("only rank 1", rank_only=1)
    nnscaler.utils.print_each_rank("only rank 0", rank_only=0)
    assert capsys.readouterr().out == "rank [0]: hello\nrank [0]: only rank 0\n"


def test_print_each_rank_through_a_logger(caplog):
    logger = logging.getLogger("tests.print_each_rank")
    with caplog.at_level(logging.INFO, logger=logger.name):
        nnscaler.utils.print_each_rank("to the log", logger=logger)
    assert [r.getMessage() for r in caplog.records] == ["rank [0]: to the log"]


def _ranked_prints(rank: int, world_size: int) -> tuple[str, list[str]]:
    out = io.StringIO()
    logger = logging.getLogger(f"tests.ranked{rank}")
    logger.setLevel(logging.INFO)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    with contextlib.redirect_stdout(out):
        nnscaler.utils.print_each_rank("hi")
        nnscaler.utils.print_each_rank("just one", rank_only=1)
        nnscaler.utils.rank_zero_only(lambda: print("rank zero only"))()
    nnscaler.utils.print_each_rank("logged", logger=logger)
    return out.getvalue(), records


def test_print_each_rank_on_two_ranks(tmp_path):
    results = spawn(_ranked_prints, 2, tmp_path, timeout=60)
    assert results[0] == ("rank [0]: hi\nrank zero only\n", ["rank [0]: logged"])
    assert results[1] == ("rank [1]: hi\nrank [1]: just one\n", ["rank [1]: logged"])


def test_enforce_zero_num_worker_restores_the_class():
    data = list(range(4))
    with nnscaler.utils.enforce_zero_num_worker(torch.utils.data.DataLoader):
        inside = torch.utils.data.DataLoader(data, num_workers=2, prefetch_factor=4, persistent_workers=True)
    after = torch.utils.data.DataLoader(data, num_workers=2)
    assert (inside.num_workers, inside.prefetch_factor, inside.persistent_workers) == (0, None, False)
    assert after.num_workers == 2


def test_unannotated_ops_trace_as_nodes_and_split():
    model, make_batch = nnscaler08_ops.build()
    graph = capture(model, make_batch(0, 4))
    ops = {n.op: n for n in graph.nodes}
    assert "nnscaler_user.gated_unannotated.default" in ops
    assert "nnscaler_user.halves_unannotated.default" in ops
    assert len(ops["nnscaler_user.halves_unannotated.default"].outputs) == 2
    plan = make_plan(graph, "tp", ComputeConfig(2, 2))
    assert plan.node(ops["nnscaler_user.gated_unannotated.default"].name).split == "h"


def test_unannotated_ops_parity_tp2(tmp_path):
    run_parity("tests.nnscaler08_ops:build", "tp", 2, 2, tmp_path=tmp_path)
    code = next(tmp_path.glob("**/gencode0.py")).read_text()
    assert "torch.ops.nnscaler_user.gated_unannotated.default(" in code
    assert "import tests.nnscaler08_ops" in code


def test_unannotated_op_returning_a_non_tensor_is_refused_by_name():
    with pytest.raises(TypeError, match="norm_unannotated has no return annotation.*returned float"):
        nnscaler08_ops.norm_unannotated(torch.randn(3, 4))
    with pytest.raises(TraceError, match="norm_unannotated has no return annotation.*annotate its return"):
        capture(nnscaler08_ops.BadOpModel(), {"x": torch.randn(4, 16)})
