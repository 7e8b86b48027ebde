"""nnscaler: a source-to-source parallelizing compiler for PyTorch (public names follow nnScaler v0.8)."""

from nnscaler.config import BroadcastGenFilesStrategy, ComputeConfig, ReuseType
from nnscaler.errors import CodegenError, CompileError, ConfigError, PartitionError, PlanError, TraceError
from nnscaler.graph.capture.markers import anchor, constant_folding, fold_constant, no_constant_folding
from nnscaler.graph.ops import register_op
from nnscaler.logs import configure_from_env as _configure_logging
from nnscaler.parallel import parallelize
from nnscaler.runtime import (
    ParallelModule,
    broadcast_weights,
    build_optimizer,
    deduped_state_dict,
    init,
    load_deduped_state_dict,
    load_merged_state_dict,
    load_sharded_state_dict,
    merge_state_dicts,
    uninit,
)
from nnscaler.runtime.chunked_loss import chunk_linear_cross_entropy
from nnscaler.runtime.grads.sync_flags import sync_grad_when
from nnscaler.version import __version__

_configure_logging()  # $NNSCALER_LOG=info: what the compiler does, phase by phase

__all__ = [
    "__version__",
    "ComputeConfig",
    "ReuseType",
    "BroadcastGenFilesStrategy",
    "parallelize",
    "ParallelModule",
    "build_optimizer",
    "merge_state_dicts",
    "load_merged_state_dict",
    "deduped_state_dict",
    "load_deduped_state_dict",
    "load_sharded_state_dict",
    "broadcast_weights",
    "sync_grad_when",
    "register_op",
    "chunk_linear_cross_entropy",
    "anchor",
    "constant_folding",
    "no_constant_folding",
    "fold_constant",
    "init",
    "uninit",
    "TraceError",
    "PlanError",
    "PartitionError",
    "CodegenError",
    "CompileError",
    "ConfigError",
]
