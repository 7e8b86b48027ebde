"""The `nnscaler` logger: quiet by default (Python's WARNING), `NNSCALER_LOG=info` (or debug,
warning, ...) prints what the compiler does: each compile phase and its time, the plan, where the
code went. Modules log to children of it (`logging.getLogger("nnscaler.parallel")`, ...)."""

from __future__ import annotations

import logging

from nnscaler import env_vars

__all__ = ["ENV", "configure_from_env"]

ENV = "NNSCALER_LOG"


class _RankFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        record.rank = env_vars.read("RANK") or 0
        return super().format(record)


def configure_from_env() -> None:
    """Give the `nnscaler` logger a level and a stderr handler when $NNSCALER_LOG names a level."""
    level = env_vars.read(ENV)  # ConfigError (a ValueError) for a name that is not a level
    if level is None:
        return
    logger = logging.getLogger("nnscaler")
    logger.setLevel(level)
    if not any(getattr(h, "_nnscaler", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(_RankFormatter("[nnscaler rank %(rank)s] %(name)s: %(message)s"))
        handler._nnscaler = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
