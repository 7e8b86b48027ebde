"""The `nnscaler` logger: quiet by default; NNSCALER_LOG=info shows each compile phase with its time,
the plan, and where the code went (or that it was reused)."""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest

from nnscaler import ComputeConfig, parallelize
from nnscaler.logs import ENV, configure_from_env


def test_compile_reports_phases_plan_and_output(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    from tests import zoo

    model, make_batch = zoo.build("mlp")
    caplog.set_level(logging.INFO, logger="nnscaler")
    kw: dict[str, Any] = {"gen_savedir": tmp_path, "load_module": False}
    parallelize(model, make_batch(0, 4), "tp", ComputeConfig(2, 4), **kw)
    text = caplog.text
    assert "policy 'tp' over plan_ngpus=2, 2 data-parallel replica(s)" in text
    for phase in ("capture", "plan", "partition", "codegen"):
        assert re.search(rf"{phase} \d+\.\d\ds", text), f"no time for {phase}: {text}"
    assert "generated code: " in text and "gencode{0..3}.py" in text
    caplog.clear()
    parallelize(model, make_batch(0, 4), "tp", ComputeConfig(2, 4), reuse="moo", **kw)
    assert "reusing the code generated in" in caplog.text and "compiled" not in caplog.text


def test_level_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    logger = logging.getLogger("nnscaler")
    saved = (logger.level, list(logger.handlers))
    try:
        monkeypatch.delenv(ENV, raising=False)
        configure_from_env()
        assert logger.level == saved[0] and logger.handlers == saved[1], "quiet by default"
        monkeypatch.setenv(ENV, "info")
        configure_from_env()
        configure_from_env()  # idempotent: one handler
        assert logger.level == logging.INFO
        assert sum(getattr(h, "_nnscaler", False) for h in logger.handlers) == 1
        monkeypatch.setenv(ENV, "chatty")
        with pytest.raises(ValueError, match="NNSCALER_LOG='chatty' is not a logging level"):
            configure_from_env()
    finally:
        logger.setLevel(saved[0])
        logger.handlers[:] = saved[1]
