"""Non-persistent buffers (`register_buffer(..., persistent=False)`) of a ParallelModule: no state dict
holds them, so a module built without its initial weights (`parallelize(..., init_module_params=False)`)
has them uninitialised, and no checkpoint load fills them. Running it anyway would compute with garbage,
silently; so (as nnScaler 0.8) the module tracks them and refuses forward / train_step / infer_step
until they are written.

A buffer counts as written when the module's loaders write it (`ParallelModule._write`: the initial
weights, `load_merged_state_dict` of a dict holding it, the constants file), when `broadcast_weights`
copies it from the data-parallel source rank, or when the user, having set them, calls
`mark_non_persistent_buffers_inited()`.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["BuffersInitMixin", "NOT_INITED", "FIX"]

_logger = logging.getLogger(
    "nnscaler.runtime.module"
)  # ParallelModule's logger (nnScaler 0.8 users catch it)

NOT_INITED = "Non-persistent buffers haven't been initialized."
"""The start of the RuntimeError raised when they are used uninitialised (nnScaler 0.8's message)."""

FIX = (
    "Either build the module with init_module_params=True on (at least) the first rank of each "
    "data-parallel group and call nnscaler.broadcast_weights(module), or set the buffers yourself and "
    "call module.mark_non_persistent_buffers_inited()"
)


class BuffersInitMixin:
    """ParallelModule's bookkeeping of which non-persistent buffers were never written."""

    fullmap: dict[str, Any]
    rank: int
    _buffers: dict[str, Any]

    def _uninit_buffers(self) -> set[str]:
        pending = self.__dict__.get("_pending_buffers")  # set by _reset_buffers_init in load_shards
        return pending if pending is not None else set()

    def _reset_buffers_init(self) -> None:
        """Just allocated (`load_shards`): every non-persistent buffer is unwritten."""
        pending = {name for name, info in self.fullmap.items() if not info.is_param and not info.persistent}
        self.__dict__["_pending_buffers"] = pending
        for name in pending:  # NaN until written: never stale memory that happens to look valid
            data = self._buffers.get(name)
            if data is not None and data.is_floating_point():
                data.fill_(float("nan"))

    def _buffer_written(self, local_name: str) -> None:
        self._uninit_buffers().discard(local_name)

    def _uninit_buffer_names(self) -> list[str]:
        return sorted(self.fullmap[n].original_name for n in self._uninit_buffers())

    @property
    def non_presistent_buffers_inited(self) -> bool:
        """Whether every non-persistent buffer holds a value (nnScaler 0.8's name, spelling kept)."""
        return not self._uninit_buffers()

    @property
    def non_persistent_buffers_inited(self) -> bool:
        """The same as `non_presistent_buffers_inited`, spelled correctly."""
        return not self._uninit_buffers()

    def mark_non_persistent_buffers_inited(self) -> None:
        """Declare the non-persistent buffers set (by you: e.g. `module.inv_freq.copy_(...)`), which
        lets forward / train_step / infer_step run."""
        self._uninit_buffers().clear()

    def _warn_uninit_buffers(self) -> None:
        """Log which non-persistent buffers no load filled, and how to fill them (none: nothing)."""
        names = self._uninit_buffer_names()
        if names:
            _logger.warning(
                "%s (rank %d): non-persistent buffers %s were not initialized. Non-persistent buffers cannot "
                "be initialized with load_state_dict / load_merged_state_dict / load_deduped_state_dict (no "
                "state dict holds them). %s.",
                type(self).__name__,
                self.rank,
                names,
                FIX,
            )

    def _require_buffers_inited(self, what: str) -> None:
        """Before running: RuntimeError naming the uninitialised non-persistent buffers and the fix."""
        names = self._uninit_buffer_names()
        if names:
            raise RuntimeError(
                f"{NOT_INITED} {type(self).__name__}.{what} on rank {self.rank} would compute with the "
                f"uninitialised values of {names}. {FIX}."
            )
