"""Saving the trainer's state into checkpoints and resuming from them, under the same plan or another.

What a checkpoint holds per rank (`{rank}.ckpt`): `model` and `optimizer` state dicts (this rank's
pieces; deduped ones drop replicated tensors), `lr_scheduler`, `train_status` (next epoch, micro-batch
position within it, step, best loss), `rng_states`, `train_args`, `rank`, `world_size`, `plan`, and
the nnscaler `version`. A merged checkpoint (`merged.ckpt`) holds the single-device `model` and
`optimizer` state dicts and the per-rank `rng_states` list.

Resuming under the same plan and world size loads each rank's own file. Otherwise (another plan,
policy or GPU count) the saved ranks' state dicts are merged into single-device ones
(`merge_state_dicts`) and each rank takes its shards (`load_merged_state_dict`).
"""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

import nnscaler.cli.checkpoint as ck
from nnscaler.cli.configs import CheckpointConfig
from nnscaler.cli.console import say
from nnscaler.cli.loader_state import loader_state, restore_loader
from nnscaler.cli.loading import load_type
from nnscaler.cli.mixed import plan_of
from nnscaler.cli.state import rng_states
from nnscaler.cli.trainer_view import TrainerView
from nnscaler.errors import CheckpointError
from nnscaler.runtime.checkpoint import load_merged_state_dict, merge_state_dicts
from nnscaler.runtime.checkpoint.keys import module_keys
from nnscaler.runtime.checkpoint.save_types import (
    MERGED,
    PER_RANK_SAVE_TYPES,
    load_local_state_dicts,
    local_state_dicts,
)
from nnscaler.version import __version__

__all__ = ["save", "resume", "check_before_start", "merge_checkpoint", "read_merged"]

logger = logging.getLogger(__name__)


class SavingTrainer(TrainerView, Protocol):
    """What saving and resuming use of the Trainer: its public state and the step it last saved."""

    _saved_step: int
    dataloader_resumed: bool


def _common(trainer: SavingTrainer) -> dict[str, Any]:
    loader = loader_state(trainer)
    return {
        **({"dataloader": loader} if loader is not None else {}),
        "lr_scheduler": trainer.lr_scheduler.state_dict() if trainer.lr_scheduler is not None else None,
        "train_status": dict(trainer.train_status),
        "rng_states": rng_states(),
        "train_args": trainer.train_args.to_dict(),
        "rank": trainer.rank,
        "world_size": trainer.world_size,
        "plan": plan_of(trainer.model),
        "version": __version__,
    }


def _gather(obj: Any, world_size: int) -> list[Any] | None:
    """Every rank's `obj` on rank 0 (None elsewhere)."""
    if world_size == 1:
        return [obj]
    out: list[Any] | None = [None] * world_size if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def save(trainer: SavingTrainer, epoch: int) -> Path | None:
    """Write a checkpoint of the trainer's current state (every rank calls it)."""
    cfg = trainer.train_args.checkpoint
    status = trainer.train_status
    if cfg.no_save:
        return None
    name = f"{epoch:04d}-{status['step']:04d}"
    val = trainer.last_val_loss
    loss = val if val is not None else (trainer.losses[-1] if trainer.losses else None)
    # a tie moves `best` to the newer step, as nnScaler 0.8 does (bf16 losses tie often)
    is_best = loss is not None and loss <= status["best_loss"]
    if is_best:
        status["best_loss"] = loss
    common = _common(trainer)
    model, opt = trainer.model, trainer.optimizer
    if cfg.save_type == MERGED:
        pieces = _gather((model.state_dict(), opt.state_dict(), common), trainer.world_size)
        files = {}
        if pieces is not None:
            merged_model, merged_opt = merge_state_dicts([p[0] for p in pieces], [p[1] for p in pieces])
            files = {
                ck.MERGED_FILE: {
                    **pieces[0][2],
                    "model": merged_model,
                    "optimizer": merged_opt,
                    "rng_states": [p[2]["rng_states"] for p in pieces],
                    **_loader_states([p[2] for p in pieces]),
                }
            }
    else:
        model_sd, opt_sd = local_state_dicts(model, opt, cfg.save_type)
        files = {
            ck.rank_file(Path("."), trainer.rank).name: {**common, "model": model_sd, "optimizer": opt_sd}
        }
    for payload in files.values():
        trainer.hook.on_save_checkpoint(trainer, payload)
    plans = _gather(plan_of(model), trainer.world_size)
    info = {
        "save_type": cfg.save_type,
        "world_size": trainer.world_size,
        "plans": plans,
        "plan_ngpus": trainer.train_args.compute_config.plan_ngpus,
        "step": status["step"],
        "epoch": epoch,
        "loss": loss,
    }
    save_dir = Path(cfg.save_dir)
    final = ck.write_checkpoint_dir(save_dir, name, trainer.rank, files, info)
    if trainer.rank == 0:
        if cfg.save_last:
            ck.point(save_dir, "last", final, cfg.symlink_best_and_last)
        if cfg.save_best and is_best:
            ck.point(save_dir, "best", final, cfg.symlink_best_and_last)
        if cfg.keep_last_n_checkpoints:
            ck.prune(save_dir, cfg.keep_last_n_checkpoints)
    ck.barrier()
    trainer._saved_step = status["step"]
    say(trainer.rank, f"checkpoint saved: {final} (step {status['step']})")
    return final


def read_merged(path: Path, convert_fn: Any = None) -> dict[str, Any]:
    """A checkpoint (directory of any save type, or merged file) as one dict with single-device
    `model` / `optimizer` state dicts; the other entries come from rank 0's file."""
    path = ck.resolve_checkpoint(path)
    if path.is_file():
        return ck.load_file(path, convert_fn)
    info = ck.checkpoint_info(path)
    if info["save_type"] == MERGED:
        return ck.load_file(path / ck.MERGED_FILE, convert_fn)
    datas = [ck.load_file(ck.rank_file(path, r), convert_fn) for r in range(info["world_size"])]
    try:
        model_sd, opt_sd = merge_state_dicts(
            [d["model"] for d in datas if d["model"]], [d["optimizer"] for d in datas if d["model"]]
        )
    except (CheckpointError, ValueError, KeyError) as err:
        raise CheckpointError(f"checkpoint {path}: its ranks' state dicts cannot be merged: {err}") from err
    return {
        **datas[0],
        "model": model_sd,
        "optimizer": opt_sd,
        "rng_states": [d["rng_states"] for d in datas],
        **_loader_states(datas),
    }


def _loader_states(datas: list[dict[str, Any]]) -> dict[str, Any]:
    """`{"dataloader": [each rank's state]}` when the ranks saved their dataloader's state, else {}."""
    if not any("dataloader" in d for d in datas):
        return {}
    return {"dataloader": [d.get("dataloader") for d in datas]}


def check_before_start(cfg: CheckpointConfig, rank: int = 0, compile_only: bool = False) -> None:
    """Before anything is compiled or written: what an interrupted save left in `save_dir` is put right
    and reported (nnscaler.cli.checkpoint_recovery), the checkpoint to resume from must be complete, and a
    run that starts afresh moves an earlier run's checkpoints out of its way (rank 0, into
    `save_dir/earlier_runs/`; the other ranks wait for it). Compiling only writes no checkpoint."""
    if not compile_only and (cfg.resume_from or not cfg.no_save):
        # an interrupted save's leftovers: put right (rank 0) and said, before `last` is read
        found = ck.recover_save_dir(Path(cfg.save_dir)) if rank == 0 else []
        if found:
            say(rank, f"checkpoint.save_dir {cfg.save_dir}: an interrupted save left: " + "; ".join(found))
        ck.barrier()
    path = cfg.get_resume_checkpoint()
    if path is not None:
        ck.resolve_checkpoint(path)
    elif not cfg.no_save and not compile_only:
        moved = ck.archive_earlier_run(Path(cfg.save_dir)) if rank == 0 else None
        if moved is not None:
            say(rank, f"this run starts afresh: the earlier run's checkpoints moved to {moved}")
        ck.barrier()


def resume(trainer: SavingTrainer) -> None:
    """Load the checkpoint that `checkpoint.resume_from` names, if any (every rank calls it)."""
    cfg = trainer.train_args.checkpoint
    path = cfg.get_resume_checkpoint()
    if path is None:
        if cfg.resume_from and cfg.resume_from.checkpoint in ("last", "best"):
            logger.info(
                "no %s checkpoint under %s: training from scratch", cfg.resume_from.checkpoint, cfg.save_dir
            )
        return
    path = ck.resolve_checkpoint(path)
    opts = cfg.resume_from
    convert = None
    if opts.convert_fn:
        convert = load_type(opts.convert_fn)
    info = ck.checkpoint_info(path)
    plans = info.get("plans") or []
    same_plan = (
        info["save_type"] in PER_RANK_SAVE_TYPES
        and info.get("world_size") == trainer.world_size == len(plans)
        and plans[trainer.rank] == plan_of(trainer.model)
        and not opts.with_merged
    )
    model, opt = trainer.model, trainer.optimizer
    if same_plan:
        data = ck.load_file(ck.rank_file(path, trainer.rank), convert)
        trainer.hook.on_load_checkpoint(trainer, data)
        try:
            load_local_state_dicts(model, info["save_type"], data["model"], opt, data["optimizer"])
        except (CheckpointError, ValueError, RuntimeError, KeyError) as err:
            raise CheckpointError(f"checkpoint {path} does not fit this model: {err}") from err
        rng = data["rng_states"]
    else:
        data = read_merged(path, convert)
        trainer.hook.on_load_checkpoint(trainer, data)
        _check_keys(trainer, path, data["model"])
        try:
            with warnings.catch_warnings():  # keys were checked over all ranks above
                warnings.simplefilter("ignore")
                load_merged_state_dict(model, data["model"], opt, data["optimizer"], strict=False)
        except (CheckpointError, ValueError, RuntimeError, KeyError) as err:
            raise CheckpointError(f"checkpoint {path} does not fit this model: {err}") from err
        states = data["rng_states"]
        rng = states[trainer.rank] if trainer.rank < len(states) else states[0]
    if trainer.lr_scheduler is not None and data.get("lr_scheduler") is not None:
        trainer.lr_scheduler.load_state_dict(data["lr_scheduler"])
    trainer.train_status.update(data["train_status"])
    trainer.dataloader_resumed = restore_loader(trainer, data.get("dataloader"), merged=not same_plan)
    trainer.pending_rng = rng
    trainer._saved_step = trainer.train_status["step"]
    trainer.hook.after_load_checkpoint(trainer, data)
    target = ck.pointer_target(path)  # last, best: the step directory they link into
    shown = f"{path} -> {target}" if target is not None else str(path)
    say(trainer.rank, f"resumed from {shown} at step {trainer.train_status['step']}")


def _check_keys(trainer: SavingTrainer, path: Path, model_sd: dict[str, Any]) -> None:
    """The merged state must hold every tensor of this rank and nothing that no rank holds (a rank of a
    pipeline holds only its stage: the check is over the union of all ranks' keys)."""
    keys = module_keys(trainer.model)
    saved = {k for k in model_sd if not k.endswith("_extra_state")}
    missing = sorted(names[0] for names in keys.tensors if not any(n in saved for n in names))
    union = [keys.accepted]
    if trainer.world_size > 1:
        union = [None] * trainer.world_size
        dist.all_gather_object(union, keys.accepted)
    unexpected = sorted(saved - set().union(*union))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {path} does not fit this model: missing keys {missing[:10]}, unexpected keys "
            f"{unexpected[:10]} (a checkpoint of another model, or of a model built with other arguments)"
        )


def merge_checkpoint(checkpoint_files: list[str] | str, output_file: str) -> None:
    """Merge a checkpoint (its directory, one of its files, or its per-rank files) into `output_file`:
    `.safetensors` gets the model weights; any other name a torch file with model and optimizer."""
    if isinstance(checkpoint_files, (str, Path)):
        checkpoint_files = [checkpoint_files]
    first = Path(checkpoint_files[0])
    # `last` / `best` missing after a crash: resolve_checkpoint recovers them
    directory = first if first.is_dir() or first.name in ck.POINTERS else first.parent
    merged = read_merged(directory)
    out = Path(output_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".safetensors":
        weights = {
            k: v.detach().contiguous() for k, v in merged["model"].items() if isinstance(v, torch.Tensor)
        }
        ck.atomic_save(_untie(weights), out, write=_save_safetensors_fsynced)
    else:
        ck.atomic_torch_save(merged, out)


def _save_safetensors_fsynced(path: Path, weights: dict[str, torch.Tensor]) -> None:
    """safetensors' save_file into `path`, flushed to disk (atomic_save renames it into place)."""
    from safetensors.torch import save_file

    save_file(weights, str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _untie(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory (tied weights): give each its own copy."""
    seen: set[int] = set()
    out = {}
    for k, v in weights.items():
        ptr = v.untyped_storage().data_ptr()
        out[k] = v.clone() if ptr in seen else v
        seen.add(ptr)
    return out
