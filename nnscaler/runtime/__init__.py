"""Runtime of generated code: process groups, autograd-aware collectives, ParallelModule, checkpoints.

Imports only torch, `nnscaler.config` and `nnscaler.errors` besides its own modules.
"""

from nnscaler.runtime import comm
from nnscaler.runtime.checkpoint import (
    broadcast_weights,
    deduped_state_dict,
    load_deduped_state_dict,
    load_merged_state_dict,
    load_sharded_state_dict,
    merge_state_dicts,
)
from nnscaler.runtime.device import init, runtime_device, uninit
from nnscaler.runtime.grads.mixed_precision import DynamicLossScaler, MixedPrecisionAdam, MixedPrecisionAdamW
from nnscaler.runtime.grads.zero import ZeroOptimizer
from nnscaler.runtime.module import ParallelModule
from nnscaler.runtime.optimizer import build_optimizer
from nnscaler.runtime.shard import assemble_shards, shard_slice

__all__ = [
    "ParallelModule",
    "comm",
    "init",
    "uninit",
    "runtime_device",
    "build_optimizer",
    "ZeroOptimizer",
    "MixedPrecisionAdam",
    "MixedPrecisionAdamW",
    "DynamicLossScaler",
    "merge_state_dicts",
    "load_merged_state_dict",
    "deduped_state_dict",
    "load_deduped_state_dict",
    "load_sharded_state_dict",
    "broadcast_weights",
    "shard_slice",
    "assemble_shards",
]
