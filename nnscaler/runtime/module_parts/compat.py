"""nnScaler 0.8's ParallelModule members that our own API names differently (mixed into
ParallelModule), so code written for nnScaler runs unchanged: `reducers`, `parameters_for_broadcast`,
`parameters_for_calc_gnorm`, the per-rank checkpoint files of `get_checkpoint` /
`save_checkpoint` / `merge_checkpoints`, and `merge_partial_states`."""

from __future__ import annotations

import glob
import inspect
import os
import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from nnscaler.runtime.checkpoint.files import atomic_save, load_file
from nnscaler.runtime.checkpoint.formats import EXTRA_STATE_FORMAT, EXTRA_STATE_KEY, OPTIMIZER_META_KEY

__all__ = ["ModuleCompatMixin", "ParamsInfo"]


@dataclass(frozen=True)
class ParamsInfo:
    """nnScaler's gradient-norm bookkeeping of one reducer's parameters."""

    ranks: tuple[int, ...]
    """The ranks the parameters are reduced over (this rank alone for parameters without a reducer)."""
    params: list[nn.Parameter]
    """What the optimizer steps for them (this rank's slices under ZeRO)."""
    param_names: list[str]
    zero_ngroups: int


class ModuleCompatMixin:
    """Mixed into ParallelModule (it uses its `reducer`, `fullmap`, `state_dict`, ...)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """A keyword argument valued `inspect.Parameter.empty` is no argument, as at trace time: nnScaler
        0.8's examples call the module with the dict they built from forward's signature (a
        transformers model's `**kwargs` gives `kwargs=Parameter.empty`)."""
        if kwargs:
            kwargs = {k: v for k, v in kwargs.items() if v is not inspect.Parameter.empty}
        return super().__call__(*args, **kwargs)

    @property
    def reducers(self) -> list[Any]:
        """nnScaler's list of reducers: ours has one gradient reducer per module (or none)."""
        red = self.reducer  # type: ignore[attr-defined]
        return [] if red is None else [red]

    def parameters_for_broadcast(self) -> list[nn.Parameter]:
        """The tensors `broadcast_weights` sends between data-parallel replicas: every parameter."""
        return list(self.parameters())  # type: ignore[attr-defined]

    def parameters_for_calc_gnorm(self) -> list[ParamsInfo]:
        """nnScaler's per-reducer parameter groups for the gradient norm."""
        import torch.distributed as dist

        names = {id(p): n for n, p in self.named_parameters()}  # type: ignore[attr-defined]
        out: list[ParamsInfo] = []
        cfg = getattr(self, "compute_config", None)
        ngroups = cfg.zero_ngroups if cfg is not None and cfg.use_zero else 1
        covered: set[int] = set()
        for red in self.reducers:
            ranks = tuple(dist.get_process_group_ranks(red.group))
            opt_params = [piece.param for piece in red.pieces] if red.zero else list(red.params)
            out.append(ParamsInfo(ranks, opt_params, [names[id(p)] for p in red.params], ngroups))
            covered.update(id(p) for p in red.params)
        me = (dist.get_rank(),) if dist.is_initialized() else (0,)
        for p in self.parameters():  # type: ignore[attr-defined]
            if id(p) not in covered and p.requires_grad:  # frozen parameters have no gradient
                out.append(ParamsInfo(me, [p], [names[id(p)]], 1))
        return out

    # ---- nnScaler's per-rank checkpoint files -----------------------------------------------------------

    def get_checkpoint(self, optimizer: torch.optim.Optimizer | None = None) -> tuple[Any, Any, Any, Any]:
        """(state dict, dist_param_map, param_area_map, optimizer state dict) of this rank."""
        area = {name: info.to_meta() for name, info in self.fullmap.items()}  # type: ignore[attr-defined]
        opt = optimizer.state_dict() if optimizer is not None else None
        return self.state_dict(), self.dist_param_map, area, opt  # type: ignore[attr-defined]

    def save_checkpoint(
        self, optimizer: torch.optim.Optimizer | None = None, filename_prefix: str | None = None
    ) -> str:
        """Write this rank's checkpoint to `{filename_prefix}-{rank}.ckpt` (atomically); returns the path."""
        prefix = "dist_checkpoint" if filename_prefix is None else filename_prefix
        state, dist_map, area, opt = self.get_checkpoint(optimizer)
        path = f"{prefix}-{self.rank}.ckpt"  # type: ignore[attr-defined]
        atomic_save(
            {
                "state_dict": state,
                "dist_param_map": dist_map,
                "param_area_map": area,
                "optim_state_dict": opt,
            },
            path,
        )
        return path

    @staticmethod
    def merge_partial_states(
        state_dicts: list[tuple[Any, ...]], zero_idx_maps: list[Any] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """nnScaler's merge of per-rank `(model_state_dict, optimizer_state_dict, dist_param_map,
        fullmap)` tuples (one per rank, in rank order) into (full model state dict, full optimizer
        state dict or None).

        Our state dicts carry their own sharding metadata and go to `merge_state_dicts` as they are;
        a dict without it (e.g. `{name: p.grad for name, p in module.named_parameters()}`) is keyed by
        the module's local names and described by the tuple's fullmap, as nnScaler reads it (all
        entries one plan: `plan_ngpus = len(state_dicts)`). Entries set to None (deduplicated ranks)
        are skipped. Optimizer state dicts without our metadata and `zero_idx_maps` are ignored with
        a warning (our optimizer state dicts describe their ZeRO slices themselves).
        """
        from nnscaler.runtime.checkpoint.merge import merge_state_dicts

        if zero_idx_maps is not None:
            _ignored(
                "zero_idx_maps is ignored (the optimizer state dicts describe their ZeRO slices themselves)"
            )
        entries = [e for e in state_dicts if e[0] is not None]
        models = [_described(e, rank, len(entries)) for rank, e in enumerate(entries)]
        opts = [e[1] for e in entries if len(e) > 1 and e[1] is not None]
        if opts and not all(OPTIMIZER_META_KEY in o for o in opts):
            _ignored("the optimizer state dicts have no nnscaler metadata (build_optimizer's): not merged")
            opts = []
        return merge_state_dicts(models, opts or None)

    @staticmethod
    def merge_checkpoints(filename_prefix: str = "dist_checkpoint") -> str:
        """Merge the `{filename_prefix}-{rank}.ckpt` files of every rank into `{filename_prefix}.full.ckpt`
        (single-device model and optimizer state dicts); returns its path."""
        from nnscaler.runtime.checkpoint.merge import merge_state_dicts

        pattern = re.compile(re.escape(os.path.basename(filename_prefix)) + r"-(\d+)\.ckpt$")
        files = sorted(
            (int(m.group(1)), f)
            for f in glob.glob(f"{glob.escape(filename_prefix)}-*.ckpt")
            if (m := pattern.search(os.path.basename(f)))
        )
        if not files:
            raise FileNotFoundError(f"merge_checkpoints: no {filename_prefix}-<rank>.ckpt files")
        ckpts = [load_file(f, weights_only=True) for _, f in files]  # errors name the file
        opts = [c["optim_state_dict"] for c in ckpts]
        model, opt = merge_state_dicts(
            [c["state_dict"] for c in ckpts], opts if all(o is not None for o in opts) else None
        )
        path = f"{filename_prefix}.full.ckpt"
        atomic_save({"state_dict": model, "optim_state_dict": opt}, path)
        return path


def _ignored(what: str) -> None:
    warnings.warn(f"merge_partial_states: {what}", stacklevel=3)


def _described(entry: tuple[Any, ...], rank: int, nranks: int) -> dict[str, Any]:
    """A rank's model state dict with our metadata: as given when it has it, else rebuilt from the
    entry's fullmap (local name -> attribute info) under original names."""
    sd = entry[0]
    fullmap = entry[3] if len(entry) > 3 else None
    if any(k.endswith(EXTRA_STATE_KEY) for k in sd) or not fullmap:
        return sd
    out: dict[str, Any] = {}
    metas: dict[str, Any] = {}
    for local, value in sd.items():
        info = fullmap.get(local)
        if info is not None:
            out[info.original_name] = value
            metas[info.original_name] = info.to_meta()
    out[EXTRA_STATE_KEY] = {
        "format": EXTRA_STATE_FORMAT,
        "rank": rank,
        "world_size": nranks,
        "plan_ngpus": nranks,
        "fullmap": metas,
        "aliases": {},
    }
    return out
