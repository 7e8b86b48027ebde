"""nnscaler.parallelize: compile a module once (rank 0) and load this rank's generated ParallelModule."""

from __future__ import annotations

import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nnscaler.config import BroadcastGenFilesStrategy, ComputeConfig, ReuseType
from nnscaler.errors import ConfigError
from nnscaler.parallel.compile import compile_module
from nnscaler.parallel.fingerprint import fingerprint
from nnscaler.parallel.savedir import module_outdir
from nnscaler.policies import resolve_policy
from nnscaler.version import __version__

__all__ = ["parallelize"]


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _needs_generation(outdir: Path, fp: dict, reuse: ReuseType, cfg: ComputeConfig) -> bool:
    fp_file = outdir / "fingerprint.json"
    complete = fp_file.exists() and all(
        (outdir / f"gencode{r}.py").exists() for r in range(cfg.runtime_ngpus)
    )
    if reuse == ReuseType.OVERRIDE or not complete:
        return True
    if reuse == ReuseType.GRAPH:
        return True
    same = json.loads(fp_file.read_text()) == json.loads(json.dumps(fp))
    if same:
        return False
    if reuse == ReuseType.MATCH:
        raise ConfigError(
            f"reuse='match' but the code in {outdir} was generated for a different model, dummy input, policy "
            "or ComputeConfig: pass reuse='moo' (regenerate when different) or 'override', or another gen_savedir"
        )
    return True


def _broadcast_files(outdir: Path, strategy: BroadcastGenFilesStrategy) -> None:
    """Send rank 0's generated files to the other ranks (for nodes without a shared disk)."""
    if strategy == BroadcastGenFilesStrategy.NONE or not (dist.is_available() and dist.is_initialized()):
        return
    payload = [None]
    if _rank() == 0:
        payload = [
            {p.name: p.read_text() for p in outdir.iterdir() if p.is_file() and not p.name.startswith(".")}
        ]
    dist.broadcast_object_list(payload, src=0)
    if _rank() != 0:
        from nnscaler.codegen import write_atomic

        outdir.mkdir(parents=True, exist_ok=True)
        for name, text in payload[0].items():
            if not (outdir / name).exists() or (outdir / name).read_text() != text:
                write_atomic(outdir / name, text)


def load_generated_class(outdir: Path, rank: int) -> type:
    """Import gencode{rank}.py and return its GenModel class."""
    path = outdir / f"gencode{rank}.py"
    name = f"nnscaler_gencode_{abs(hash(str(path.resolve())))}_{rank}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.GenModel


def parallelize(
    module_or_module_class: torch.nn.Module | type[torch.nn.Module],
    dummy_forward_args: dict[str, Any],
    pas_policy: str | Callable,
    compute_config: ComputeConfig,
    *,
    gen_savedir: str | Path = "./.nnscaler",
    reuse: ReuseType | str = ReuseType.MATCH,
    instance_name: str | None = None,
    load_module: bool = True,
    module_dtype: torch.dtype | None = None,
    module_fn: Callable[[], torch.nn.Module] | None = None,
    init_module_params: bool = True,
    broadcast_strategy: BroadcastGenFilesStrategy | str = BroadcastGenFilesStrategy.NONE,
):
    """Compile the module for `compute_config` and return this rank's ParallelModule.

    Rank 0 traces, plans and writes `gencode{rank}.py` for every rank under
    gen_savedir/_parallel_modules/...; the other ranks wait, then each imports its own file.
    Given a module instance, returns a ParallelModule instance holding this rank's shards of its
    weights; given a class, returns the generated class. With load_module=False returns None.
    """
    if not isinstance(compute_config, ComputeConfig):
        raise ConfigError(f"compute_config must be a ComputeConfig, got {type(compute_config).__name__}")
    try:
        reuse = ReuseType(reuse)
    except ValueError:
        raise ConfigError(f"reuse={reuse!r} is not one of {[r.value for r in ReuseType]}") from None
    try:
        broadcast_strategy = BroadcastGenFilesStrategy(broadcast_strategy)
    except ValueError:
        raise ConfigError(
            f"broadcast_strategy={broadcast_strategy!r} is not one of {[b.value for b in BroadcastGenFilesStrategy]}"
        ) from None
    if (
        dist.is_available()
        and dist.is_initialized()
        and dist.get_world_size() != compute_config.runtime_ngpus
    ):
        raise ConfigError(
            f"ComputeConfig.runtime_ngpus is {compute_config.runtime_ngpus} but the process group has "
            f"{dist.get_world_size()} ranks"
        )
    is_class = isinstance(module_or_module_class, type)
    module_class = module_or_module_class if is_class else type(module_or_module_class)
    outdir = module_outdir(gen_savedir, module_class, instance_name)
    policy_name, _ = resolve_policy(pas_policy)
    module = None
    if _rank() == 0:
        module = (
            _build(module_or_module_class, module_fn, module_dtype) if is_class else module_or_module_class
        )
        if module_dtype is not None and not is_class:
            module = module.to(module_dtype)
        fp = fingerprint(module, dummy_forward_args, policy_name, compute_config, __version__)
        if _needs_generation(outdir, fp, reuse, compute_config):
            compile_module(
                module,
                dummy_forward_args,
                pas_policy,
                compute_config,
                outdir,
                __version__,
                reuse_graph=reuse == ReuseType.GRAPH,
            )
            (outdir / "fingerprint.json").write_text(json.dumps(fp, indent=1))
    _barrier()
    _broadcast_files(outdir, broadcast_strategy)
    if not load_module:
        return None
    gen_class = load_generated_class(outdir, _rank())
    if is_class:
        return gen_class
    pm = gen_class(init_params=False)
    pm.compute_config = compute_config
    if init_module_params and not any(p.is_meta for p in module_or_module_class.parameters()):
        module = module_or_module_class
        full = dict(module.state_dict())
        # non-persistent buffers (e.g. rotary inv_freq) are not in state_dict but the module needs them
        full.update({name: b for name, b in module.named_buffers(remove_duplicate=False) if name not in full})
        pm.load_merged_state_dict(full, strict=False)
    return pm


def _build(module_class, module_fn, module_dtype):
    module = module_fn() if module_fn is not None else module_class()
    return module.to(module_dtype) if module_dtype is not None else module
