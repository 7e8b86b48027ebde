"""Imported through `init_module` by a test: the second checkpoint write dies with SIGKILL half-way
through its first file, as a crash or an OOM kill would."""

from __future__ import annotations

import os
import signal

from nnscaler.cli import checkpoint

_real_write = checkpoint._write_file
_calls = {"n": 0}


def _dying_write(path, obj):
    _calls["n"] += 1
    if _calls["n"] == 2:
        with open(path, "wb") as f:
            f.write(b"PK\x03\x04 half of a checkpoint")
            f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    _real_write(path, obj)


checkpoint._write_file = _dying_write
