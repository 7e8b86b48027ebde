"""nnScaler 0.8's `nnscaler.graph.parser.parser` import path: `_logger`, the logger its scripts attach
handlers to for tracing warnings (here: capture's logger, nnscaler.graph.capture)."""

import logging

_logger = logging.getLogger("nnscaler.graph.capture")

__all__: list[str] = []
