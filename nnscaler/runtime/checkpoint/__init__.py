"""Checkpoints of parallel modules: save, merge, load and broadcast state dicts under any plan.

`formats` holds the state-dict keys and format tags every part agrees on; `load` the public
functions (re-exported here); `merge` rebuilds single-device state dicts from per-rank pieces,
after `checks` verified them; `keys` says which keys a module takes; `broadcast` sends weights and
optimizer state within data-parallel groups; `piece_meta` records who saved an optimizer state
dict; `files` writes checkpoint files and per-rank directories atomically; `save_types` saves and
loads the per-rank kinds (sharded, deduped) that the Trainer and the Lightning strategy share.
"""

from nnscaler.runtime.checkpoint.load import (
    broadcast_weights,
    deduped_state_dict,
    load_deduped_state_dict,
    load_merged_state_dict,
    load_sharded_state_dict,
    merge_state_dicts,
)

__all__ = [
    "merge_state_dicts",
    "load_merged_state_dict",
    "deduped_state_dict",
    "load_deduped_state_dict",
    "load_sharded_state_dict",
    "broadcast_weights",
]
