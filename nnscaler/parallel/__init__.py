"""The driver: parallelize() ties capture, policies, partition and codegen together.

nnScaler 0.8's import path: its users and docs write `from nnscaler.parallel import parallelize,
ComputeConfig, build_optimizer, merge_state_dicts, ...`; every public name of its `nnscaler.parallel`
is here too (the same objects `nnscaler` exports).
"""

from nnscaler.config import BroadcastGenFilesStrategy, ComputeConfig, ReuseType
from nnscaler.parallel.compile import CompileResult, compile_module
from nnscaler.parallel.parallelize import load_generated_class, parallelize
from nnscaler.parallel.savedir import module_outdir
from nnscaler.runtime import (
    ParallelModule,
    broadcast_weights,
    build_optimizer,
    deduped_state_dict,
    load_deduped_state_dict,
    load_merged_state_dict,
    load_sharded_state_dict,
    merge_state_dicts,
)
from nnscaler.runtime.grads.sync_flags import sync_grad_when

NNSCALER_08_NAMES = (
    "ComputeConfig",
    "ReuseType",
    "BroadcastGenFilesStrategy",
    "ParallelModule",
    "parallelize",
    "build_optimizer",
    "merge_state_dicts",
    "load_merged_state_dict",
    "deduped_state_dict",
    "load_deduped_state_dict",
    "load_sharded_state_dict",
    "broadcast_weights",
    "sync_grad_when",
)
"""The public names of nnScaler 0.8's `nnscaler.parallel`, all importable from here."""

__all__ = [
    "ComputeConfig",
    "ReuseType",
    "BroadcastGenFilesStrategy",
    "ParallelModule",
    "parallelize",
    "build_optimizer",
    "merge_state_dicts",
    "load_merged_state_dict",
    "deduped_state_dict",
    "load_deduped_state_dict",
    "load_sharded_state_dict",
    "broadcast_weights",
    "sync_grad_when",
    "compile_module",
    "CompileResult",
    "module_outdir",
    "load_generated_class",
]
