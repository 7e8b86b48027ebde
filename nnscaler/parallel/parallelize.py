"""nnscaler.parallelize: compile a module once (rank 0) and load this rank's generated ParallelModule."""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nnscaler import env_vars
from nnscaler.codegen import write_atomic
from nnscaler.config import BroadcastGenFilesStrategy, ComputeConfig, ReuseType
from nnscaler.errors import ConfigError
from nnscaler.graph.capture.export import taken_forward_args
from nnscaler.parallel.artifacts import is_generated_name, read_saved, torch_bytes, verified_code
from nnscaler.parallel.compile import compile_module
from nnscaler.parallel.dirlock import compile_lock
from nnscaler.parallel.fingerprint import fingerprint
from nnscaler.parallel.nested import refuse_nested
from nnscaler.parallel.resolved_policy import ResolvedPolicy, resolve_pas_policy
from nnscaler.parallel.reuse import decide, finish_generation, start_generation
from nnscaler.parallel.savedir import (
    WEIGHTS_FILE,
    generated_files,
    is_code_file,
    is_weight_file,
    module_outdir,
)
from nnscaler.parallel.verify import should_verify, verify_capture
from nnscaler.runtime.device import bind_cuda_device
from nnscaler.runtime.dist.store_sync import next_key, publish_outcome, wait_outcome
from nnscaler.runtime.dist.timeouts import compile_timeout
from nnscaler.runtime.leaf import attach_leaf_modules
from nnscaler.runtime.module_parts.meta_weights import refuse_meta_weights
from nnscaler.runtime.module_parts.replicas import load_initial_weights, validate_init_params_sync
from nnscaler.version import __version__

_log = logging.getLogger(__name__)

__all__ = ["parallelize", "load_generated_class"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


# ---- weights -------------------------------------------------------------------------------------


def _save_weights(outdir: Path, module: torch.nn.Module) -> None:
    """The module's initial weights, for `GenModel(init_params=True)` on every rank (class input)."""
    full = dict(module.state_dict())
    full.update({n: b for n, b in module.named_buffers(remove_duplicate=False) if n not in full})
    write_atomic(outdir / WEIGHTS_FILE, torch_bytes({k: v.detach().cpu() for k, v in full.items()}))


# ---- rank 0 -> other ranks -----------------------------------------------------------------------


def _share_outcome(error: BaseException | None) -> None:
    """Rank 0 tells the other ranks whether generation worked, through the process-group store.

    The others wait on a store key, not in a collective: rank 0's compile may take longer than the
    collective timeout (they wait up to NNSCALER_COMPILE_TIMEOUT, and notice at once when rank 0's
    store is gone), and if it failed they raise `PeerError` with rank 0's error and traceback tail.
    """
    if not _distributed():
        if error is not None:
            raise error
        return
    key = next_key("parallelize")  # the n-th parallelize of every rank meets the n-th of rank 0
    if _rank() == 0:
        publish_outcome(key, error)
        if error is not None:
            raise error
        return
    wait_outcome(key, src=0, what="generate the parallel module", timeout=compile_timeout())


def _selected(name: str, strategy: BroadcastGenFilesStrategy) -> bool:
    if strategy == BroadcastGenFilesStrategy.ALL:
        return True
    if strategy == BroadcastGenFilesStrategy.NO_WEIGHTS:
        return not is_weight_file(name)
    if strategy == BroadcastGenFilesStrategy.CODE:
        return is_code_file(name)
    return False


def _is_node_leader() -> bool:
    """The rank that writes for its machine (LOCAL_RANK 0); without LOCAL_RANK every rank writes."""
    return not env_vars.read("LOCAL_RANK")  # unset or 0


def _broadcast_files(outdir: Path, strategy: BroadcastGenFilesStrategy) -> None:
    """Send rank 0's generated files to the other machines (for nodes without a shared disk).

    ALL: every file, weights included; NO_WEIGHTS: every file but the weights (`fullmodel.pt`);
    CODE: what a rank needs to import and construct its module (`gencode*.py`, `compute_config.json`,
    `constants.pt`, and `fingerprint.json`, which records their sha256); NONE: nothing. One rank per
    machine (LOCAL_RANK 0) writes; files of the sent kinds that rank 0 does not have are removed
    there, so no stale file survives. Only names nnscaler writes are sent or removed
    (`is_generated_name`): a user's own files in the directory stay as they are on every machine.
    """
    if strategy == BroadcastGenFilesStrategy.NONE or not _distributed():
        return
    rank = _rank()
    mine = [
        p.name for p in generated_files(outdir) if is_generated_name(p.name) and _selected(p.name, strategy)
    ]
    names = [mine if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    writer = rank != 0 and _is_node_leader()
    if writer:
        outdir.mkdir(parents=True, exist_ok=True)
        for old in generated_files(outdir):
            if is_generated_name(old.name) and _selected(old.name, strategy) and old.name not in names[0]:
                old.unlink()
    for name in names[0]:
        data = [(outdir / name).read_bytes() if rank == 0 else None]
        dist.broadcast_object_list(data, src=0)
        if writer:
            write_atomic(outdir / name, data[0])
    dist.barrier()  # the other ranks of a machine read what its leader wrote


# ---- loading -------------------------------------------------------------------------------------


def load_generated_class(outdir: Path, rank: int, record: dict[str, dict] | None = None) -> type:
    """Import gencode{rank}.py and return its GenModel class.

    The file (and those constructing the module reads) is first checked against the sha256 recorded
    when it was generated: `record` as rank 0 read it (parallelize sends it to every rank), or
    outdir's fingerprint.json when None; an edited, truncated or foreign file raises ConfigError
    naming it. The checked text is what runs (no bytecode cache, no second read).
    """
    path = outdir / f"gencode{rank}.py"
    if not path.exists():
        raise _no_code(path)
    source = verified_code(outdir, rank, record)
    name = f"nnscaler_gencode_{abs(hash(str(path.resolve())))}_{rank}"
    module = types.ModuleType(name)
    module.__file__ = str(path)
    module.__spec__ = importlib.util.spec_from_file_location(name, path)
    sys.modules[name] = module
    try:
        exec(compile(source, str(path), "exec"), module.__dict__)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module.GenModel


def _load_on_every_rank(outdir: Path, record: dict[str, dict] | None) -> type:
    """This rank's generated class, once every rank has found its file (see below)."""
    _check_every_rank_has_code(outdir)
    return load_generated_class(outdir, _rank(), _shared_record(record))


def _no_code(path: Path) -> ModuleNotFoundError:
    """A missing gencode file: ModuleNotFoundError, as nnScaler 0.8 raises."""
    return ModuleNotFoundError(
        f"{path} does not exist: if the ranks do not share gen_savedir's disk, parallelize with "
        "broadcast_strategy='code' (or 'no_weights', 'all') so rank 0 sends the generated files",
        name=path.stem,
    )


def _check_every_rank_has_code(outdir: Path) -> None:
    """Every rank finds its gencode file, or every rank raises (building the module needs them all: a
    rank that loaded alone would wait for the others in its process groups forever). The rank without
    the file raises ModuleNotFoundError (as nnScaler 0.8), the others ConfigError naming those ranks."""
    if not _distributed():
        return
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, (outdir / f"gencode{_rank()}.py").exists())
    missing = [r for r, ok in enumerate(found) if not ok]
    if missing and not found[_rank()]:
        raise _no_code(outdir / f"gencode{_rank()}.py")
    if missing:
        raise ConfigError(
            f"ranks {missing} do not find their generated code under {outdir} (no shared disk?): parallelize "
            "with broadcast_strategy='code' (or 'no_weights', 'all') so rank 0 sends the generated files"
        )


def _shared_record(record: dict[str, dict] | None) -> dict[str, dict] | None:
    """Rank 0's record of the generated files (read under the compile lock), on every rank: a rank
    whose disk holds other files than rank 0 wrote (no shared disk, nothing broadcast), or files
    another job rewrote since, finds out before importing them."""
    if _distributed():
        box = [record]
        dist.broadcast_object_list(box, src=0)
        record = box[0]
    return record


# ---- the entry point -----------------------------------------------------------------------------


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
    init_params_sync: str = "broadcast",
    verify: bool | None = None,
):
    """Compile the module for `compute_config` and return this rank's ParallelModule.

    Rank 0 traces, plans and writes `gencode{rank}.py` for every rank under
    gen_savedir/_parallel_modules/...; the other ranks wait, then each imports its own file.
    Given a module instance, returns a ParallelModule instance holding this rank's shards of its
    weights; given a class, returns the generated class (its `init_params=True` loads the weights
    rank 0 built, from `fullmodel.pt`). With load_module=False returns None.

    reuse: 'match' reuses generated code whose fingerprint (model sources, parameter and input
    specs, policy, ComputeConfig, versions) equals this call's and raises, naming what differs,
    otherwise; 'moo' regenerates when different; 'override' always regenerates; 'graph' plans and
    generates again from the saved traced graph after checking it matches the model.

    init_params_sync (module instance, several ranks): 'broadcast' makes every rank take its shards
    from rank 0's weights, so unseeded ranks still hold one model; 'check' compares a checksum of
    every tensor across the ranks and raises naming the first that differs; 'none' trusts each rank's.

    verify: after capture, run the captured program's single-device code and the module on the dummy
    inputs (forward and backward; also forward in the other mode where the program follows train()/eval())
    and raise CompileError naming the first module and source line where they differ. None (default): when
    the weights and dummy inputs are real and the model has under 200M parameters; True: always (ConfigError
    on meta weights); False: never. The module's buffers, `.grad` and the RNG stream are left as they were.
    """
    reuse, broadcast_strategy, init_params_sync = _checked_arguments(
        compute_config, reuse, broadcast_strategy, init_params_sync, verify
    )
    policy = resolve_pas_policy(pas_policy, compute_config.pas_config)  # every rank, before any tracing
    bind_cuda_device()  # object collectives below run on the current CUDA device under NCCL
    is_class = isinstance(module_or_module_class, type)
    if load_module and not is_class:  # fail fast; 'none' where ranks' init_module_params differ
        init_params_sync = refuse_meta_weights(module_or_module_class, init_params_sync, init_module_params)
    module_class = module_or_module_class if is_class else type(module_or_module_class)
    outdir = module_outdir(gen_savedir, module_class, instance_name)
    error, record = None, None
    if _rank() == 0:
        try:
            record = _generate(
                module_or_module_class,
                dummy_forward_args,
                policy,
                compute_config,
                outdir,
                reuse,
                module_fn,
                module_dtype,
                save_weights=is_class and init_module_params,
                require_weights=is_class and init_module_params and load_module,
                verify=verify,
            )
        except Exception as exc:  # the other ranks hear of it instead of waiting forever
            error = exc
    _share_outcome(error)
    _broadcast_files(outdir, broadcast_strategy)
    if not load_module:
        return None
    gen_class = _load_on_every_rank(outdir, record)
    if gen_class.compute_config is None:
        gen_class.compute_config = compute_config
    if is_class:
        return _generated_class(gen_class, outdir, module_or_module_class, module_fn, init_module_params)
    return _generated_instance(
        gen_class, module_or_module_class, compute_config, init_module_params, init_params_sync, module_dtype
    )


def _generated_instance(
    gen_class: type,
    module: torch.nn.Module,
    compute_config: ComputeConfig,
    init_module_params: bool,
    init_params_sync: str,
    module_dtype: torch.dtype | None,
) -> torch.nn.Module:
    """This rank's ParallelModule for a module input, in the module's train/eval mode, with its shards
    of the module's weights when init_module_params."""
    pm = gen_class(init_params=False)
    attach_leaf_modules(pm, module)  # opaque leaf modules run eagerly on pm's tensors
    pm.compute_config = compute_config
    pm.train(module.training)  # the generated code follows train()/eval() from here
    if init_module_params:  # every rank cuts its shards from rank 0's weights ('broadcast') or checks
        load_initial_weights(pm, module, init_params_sync, dtype=module_dtype)
    pm._warn_uninit_buffers()  # non-persistent buffers no load filled: name them and the fix
    return pm


def _checked_arguments(
    compute_config: ComputeConfig,
    reuse: ReuseType | str,
    broadcast_strategy: BroadcastGenFilesStrategy | str,
    init_params_sync: str,
    verify: bool | None,
) -> tuple[ReuseType, BroadcastGenFilesStrategy, str]:
    """parallelize's arguments checked on every rank before anything else (ConfigError naming the
    argument): (reuse, broadcast_strategy, init_params_sync) as enums / the checked value."""
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
    init_params_sync = validate_init_params_sync(init_params_sync)
    if verify is not None and not isinstance(verify, bool):
        raise ConfigError(
            f"verify={verify!r}: pass True, False or None (check when the model is small enough)"
        )
    if _distributed() and dist.get_world_size() != compute_config.runtime_ngpus:
        raise ConfigError(
            f"ComputeConfig.runtime_ngpus is {compute_config.runtime_ngpus} but the process group has "
            f"{dist.get_world_size()} ranks"
        )
    return reuse, broadcast_strategy, init_params_sync


def _generated_class(
    gen_class: type, outdir: Path, module_class: type, module_fn: Callable | None, init_module_params: bool
) -> type:
    """The generated class for a class input: its weights file (when rank 0 saved one) and its opaque
    leaf modules (they run the model's own code: their structure is built on the meta device)."""
    has_weights = init_module_params and (outdir / WEIGHTS_FILE).exists()
    gen_class.init_weights_file = WEIGHTS_FILE if has_weights else None
    if getattr(gen_class, "leaf_modules", ()):
        with torch.device("meta"):
            structure = module_fn() if module_fn is not None else module_class()
        attach_leaf_modules(gen_class, structure)
    return gen_class


def _generate(
    module_or_class,
    dummy_forward_args: dict,
    policy: ResolvedPolicy,
    cfg: ComputeConfig,
    outdir: Path,
    reuse: ReuseType,
    module_fn,
    module_dtype,
    save_weights: bool,
    require_weights: bool = False,
    verify: bool | None = None,
) -> dict[str, dict] | None:
    """Rank 0: build the module if given a class, and (re)generate the output directory as `reuse` says.
    Returns the record of the generated files (their sha256), as read while holding the directory's lock."""
    if isinstance(module_or_class, type):
        module = module_fn() if module_fn is not None else module_or_class()
    else:
        module = module_or_class
    if require_weights and any(p.is_meta for p in module.parameters()):
        raise ConfigError(
            f"parallelize was given the class {module_or_class.__qualname__} with init_module_params=True, but "
            f"{'module_fn' if module_fn is not None else 'its constructor'} builds the model on the meta device: "
            "there are no initial weights for GenModel(init_params=True) to load, and it would run with "
            "uninitialised weights. Build the model with real weights, or pass init_module_params=False and load "
            "a checkpoint into the module with load_merged_state_dict (or load_module=False to only compile)"
        )
    if module_dtype is not None:
        module = module.to(module_dtype)
    refuse_nested(module)
    dummy_forward_args = taken_forward_args(module, dummy_forward_args)  # extra keys: warned, dropped
    check = should_verify(verify, module, dummy_forward_args)  # verify=True on meta weights: fail fast
    fp = fingerprint(module, dummy_forward_args, policy, cfg, __version__)
    with compile_lock(outdir):  # another job compiling into the same directory waits here
        generate, graph = decide(outdir, fp, reuse, cfg)
        if generate:
            start_generation(outdir)
            result = compile_module(
                module,
                dummy_forward_args,
                policy,
                cfg,
                outdir,
                __version__,
                reuse_graph=False,
                graph=graph,
            )
            if check:  # before the fingerprint: code that failed the check is never reused
                verify_capture(
                    module,
                    dummy_forward_args,
                    result.graph,
                    outdir,
                    backward=not cfg.inference_only,
                    required=verify is True,
                )
            finish_generation(outdir, fp, cfg)  # the fingerprint, last
        else:
            _log.info("reusing the code generated in %s (reuse=%r)", outdir, ReuseType(reuse).value)
        has_storage = not any(p.is_meta for p in module.parameters())
        if save_weights and has_storage and (generate or not (outdir / WEIGHTS_FILE).exists()):
            _save_weights(outdir, module)
        return read_saved(outdir).artifacts
