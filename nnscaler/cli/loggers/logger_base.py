"""The interface of a trainer logger (rank 0 only)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

__all__ = ["LoggerBase"]


class LoggerBase(ABC):
    """setup(config) once, log_metrics(metrics, step, tag=...) per step, finalize() at the end."""

    @abstractmethod
    def setup(self, config: dict[str, Any]) -> None:
        """Called once with the run's TrainerArgs as a dict."""

    @abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: int, *, tag: str | None = None) -> None:
        """Record scalar `metrics` at `step`; `tag` prefixes their names."""

    @abstractmethod
    def finalize(self) -> None:
        """Flush and close."""
