"""The `nnscaler` logger: quiet by default (Python's WARNING), `NNSCALER_LOG=info` (or debug,
warning, ...) prints what the compiler does: each compile phase and its time, the plan, where the
code went. Modules log to children of it (`logging.getLogger("nnscaler.parallel")`, ...)."""

from __future__ import annotations

import logging
import os

__all__ = ["ENV", "configure_from_env"]

ENV = "NNSCALER_LOG"


class _RankFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        record.rank = os.environ.get("RANK", "0")
        return super().format(record)


def configure_from_env() -> None:
    """Give the `nnscaler` logger a level and a stderr handler when $NNSCALER_LOG names a level."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return
    level = logging.getLevelName(value.upper())
    if not isinstance(level, int):
        raise ValueError(f"${ENV}={value!r} is not a logging level: use debug, info, warning or error")
    logger = logging.getLogger("nnscaler")
    logger.setLevel(level)
    if not any(getattr(h, "_nnscaler", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(_RankFormatter("[nnscaler rank %(rank)s] %(name)s: %(message)s"))
        handler._nnscaler = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
