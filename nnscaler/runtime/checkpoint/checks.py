"""What `merge_state_dicts` verifies before it merges: every model state dict carries its metadata,
all come from one plan and from distinct ranks, each optimizer state dict is paired with the model
state dict of its rank, and copies of one piece held by several ranks (replicas) agree.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nnscaler.errors import CheckpointError
from nnscaler.runtime.checkpoint.formats import (
    EXTRA_STATE_FORMAT,
    EXTRA_STATE_KEY,
    OPTIMIZER_META_FORMAT,
    OPTIMIZER_META_KEY,
)

__all__ = [
    "Piece",
    "metas_of",
    "missing_metadata",
    "read_pieces",
    "pair_optimizers",
    "check_replica",
    "REPLICA_RTOL",
    "REPLICA_ATOL",
]

Meta = dict[str, Any]

REPLICA_RTOL = 1e-5
"""Relative tolerance within which two ranks' copies of a floating-point piece count as equal."""
REPLICA_ATOL = 1e-6
"""Absolute tolerance, likewise; other dtypes must be equal."""


@dataclass(frozen=True)
class Piece:
    """One rank's model state dict as merge sees it."""

    index: int
    """Position in the list given to merge_state_dicts."""
    rank: int
    """The rank that saved it (recorded in its metadata)."""
    metas: dict[str, Meta]
    """State-dict prefix -> extra state of each ParallelModule in it."""


def metas_of(sd: Mapping[str, Any]) -> dict[str, Meta]:
    """Prefix -> extra state of every ParallelModule in a rank's model state dict."""
    return {
        k[: -len(EXTRA_STATE_KEY)]: v
        for k, v in sd.items()
        if k.endswith(EXTRA_STATE_KEY) and isinstance(v, dict) and v.get("format") == EXTRA_STATE_FORMAT
    }


def missing_metadata(where: str) -> CheckpointError:
    """The error for a rank's model state dict without its ParallelModule metadata (`where` names it)."""
    return CheckpointError(
        f"{where} has no ParallelModule metadata (no '{EXTRA_STATE_KEY}' entry of format "
        f"{EXTRA_STATE_FORMAT!r}), so nothing tells which rank's shards its tensors are, or that they are "
        "shards at all: a shard would pass for the whole tensor. The entry is a dict, lost when a "
        "state dict goes through a tensor-only format such as safetensors. Save module.state_dict() with "
        f"torch.save, or keep every '{EXTRA_STATE_KEY}' entry beside the tensors (e.g. torch.save or json "
        "of those entries) and put them back before merging"
    )


def read_pieces(model_state_dicts: Sequence[Mapping[str, Any]]) -> list[Piece]:
    """The pieces, checked: metadata present, one rank per state dict, distinct ranks, one plan."""
    pieces = []
    for i, sd in enumerate(model_state_dicts):
        metas = metas_of(sd)
        if not metas:
            raise missing_metadata(f"merge_state_dicts: model state dict #{i}")
        ranks = sorted({int(m["rank"]) for m in metas.values()})
        if len(ranks) != 1:
            raise CheckpointError(
                f"merge_state_dicts: model state dict #{i} holds ParallelModules saved by ranks {ranks}; "
                "a state dict must come from one rank (module.state_dict() on that rank)"
            )
        pieces.append(Piece(i, ranks[0], metas))
    seen: dict[int, int] = {}
    for p in pieces:
        if p.rank in seen:
            raise CheckpointError(
                f"merge_state_dicts: model state dicts #{seen[p.rank]} and #{p.index} both come from rank "
                f"{p.rank}; pass each rank's state dict once"
            )
        seen[p.rank] = p.index
    _check_one_plan(pieces)
    return pieces


def _describe(plan: Any, world_size: int, plan_ngpus: int) -> str:
    name = "plan ?" if plan is None else f"plan {str(plan)[:12]}"
    if plan_ngpus == 1:
        how = "data parallel: every rank holds whole tensors"
    else:
        how = f"tensor/pipeline parallel over {plan_ngpus} devices: each rank holds pieces"
    return f"{how} ({name}, world size {world_size})"


def _check_one_plan(pieces: Sequence[Piece]) -> None:
    modules = {tuple(sorted(p.metas)) for p in pieces}
    if len(modules) > 1:
        listed = "; ".join(f"rank {p.rank}: {sorted(p.metas)}" for p in pieces)
        raise CheckpointError(
            "merge_state_dicts: the state dicts hold different ParallelModules (by state-dict prefix: "
            f"{listed}); they come from different models. Merge the state dicts of one run"
        )
    for prefix in sorted(pieces[0].metas):
        plans: dict[tuple[Any, int, int], list[int]] = {}
        for p in pieces:
            m = p.metas[prefix]
            plans.setdefault((m.get("plan"), int(m["world_size"]), int(m["plan_ngpus"])), []).append(p.rank)
        if len(plans) > 1:
            where = f" (the ParallelModule at {prefix!r})" if prefix else ""
            listed = "; ".join(f"ranks {ranks}: {_describe(*key)}" for key, ranks in plans.items())
            raise CheckpointError(
                f"merge_state_dicts: the state dicts come from different plans{where}: {listed}. Their "
                "pieces do not fit together: merge the state dicts of one run (all saved under one plan); "
                "to move a checkpoint to another plan, merge it alone and load the result with "
                "load_merged_state_dict"
            )


def pair_optimizers(
    pieces: Sequence[Piece], optimizer_state_dicts: Sequence[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """The optimizer state dict of each piece, in `pieces` order, paired by the rank each records.

    State dicts saved before ranks were recorded are paired by position, with a warning."""
    metas = [opt.get(OPTIMIZER_META_KEY) for opt in optimizer_state_dicts]
    recorded = [isinstance(m, dict) and m.get("format") == OPTIMIZER_META_FORMAT for m in metas]
    if not any(recorded):
        if len(optimizer_state_dicts) != len(pieces):
            raise CheckpointError(
                f"merge_state_dicts: {len(optimizer_state_dicts)} optimizer state dicts for {len(pieces)} "
                "model state dicts; give the optimizer state dict of each rank whose model state dict you give"
            )
        warnings.warn(
            "merge_state_dicts: the optimizer state dicts record no rank (saved by an older nnscaler); "
            "they are paired with the model state dicts by position, so give them in the same order",
            stacklevel=3,
        )
        return [optimizer_state_dicts[p.index] for p in pieces]
    if not all(recorded):
        bare = [i for i, ok in enumerate(recorded) if not ok]
        raise CheckpointError(
            f"merge_state_dicts: optimizer state dicts {bare} record no rank (no {OPTIMIZER_META_KEY!r} "
            "entry) while the others do; save each with optimizer.state_dict() of an optimizer from "
            "build_optimizer (or nnscaler.runtime.optimizer.optimizer_state_dict)"
        )
    by_rank: dict[int, int] = {}
    for i, m in enumerate(metas):
        rank = int(m["rank"])
        if rank in by_rank:
            raise CheckpointError(
                f"merge_state_dicts: optimizer state dicts #{by_rank[rank]} and #{i} both come from rank {rank}"
            )
        by_rank[rank] = i
    model_ranks = sorted(p.rank for p in pieces)
    if sorted(by_rank) != model_ranks:
        raise CheckpointError(
            f"merge_state_dicts: the optimizer state dicts come from ranks {sorted(by_rank)} but the model "
            f"state dicts from ranks {model_ranks}; give the optimizer state dict of each rank whose model "
            "state dict you give"
        )
    out = []
    for p in pieces:
        opt = optimizer_state_dicts[by_rank[p.rank]]
        saved = opt[OPTIMIZER_META_KEY].get("plans", {})
        for prefix, meta in p.metas.items():
            if prefix in saved and "plan" in meta and saved[prefix] != meta["plan"]:
                raise CheckpointError(
                    f"merge_state_dicts: the optimizer state dict of rank {p.rank} was saved under plan "
                    f"{str(saved[prefix])[:12]} but its model state dict under plan {str(meta['plan'])[:12]}; "
                    "give the optimizer state dicts saved with these model state dicts"
                )
        out.append(opt)
    return out


def _same(a: Any, b: Any) -> tuple[bool, str]:
    """Whether two copies agree (floating point within tolerance), and how they differ."""
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return False, f"{type(a).__name__} vs {type(b).__name__}"
        try:
            return bool(a == b), f"{a!r} vs {b!r}"
        except Exception:  # values without a plain == (no way to tell): accept
            return True, ""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, f"{a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    b = b.to(a.device)
    if a.is_floating_point() or a.is_complex():
        if torch.allclose(a, b, rtol=REPLICA_RTOL, atol=REPLICA_ATOL, equal_nan=True):
            return True, ""
        diff = (a.detach().double() - b.detach().double()).abs().nan_to_num(float("inf"))
        return False, f"max difference {float(diff.max()):.3g}"
    if torch.equal(a, b):
        return True, ""
    return False, f"{int((a != b).sum())} of {a.numel()} elements differ"


def check_replica(what: str, kept: tuple[int, Any], other: tuple[int, Any]) -> None:
    """Two ranks' copies of one piece (`(rank, value)`) must agree; raise naming both otherwise."""
    (rank_a, a), (rank_b, b) = kept, other
    ok, how = _same(a, b)
    if not ok:
        raise CheckpointError(
            f"merge_state_dicts: ranks {rank_a} and {rank_b} hold different copies of {what} ({how}), "
            f"though both hold the same piece (replicas must be equal, within rtol={REPLICA_RTOL}, "
            f"atol={REPLICA_ATOL}). The replicas diverged, e.g. initialised without the same seed or "
            f"trained without gradient sync. Merge the ranks of one replica, or pass "
            f"check_replicas=False to take rank {rank_a}'s copy"
        )
