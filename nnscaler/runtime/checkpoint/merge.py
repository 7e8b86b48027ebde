"""merge_state_dicts: rebuild the single-device model and optimizer state dicts from per-rank ones.

A model state dict of a rank is `module.state_dict()`: ParallelModule tensors under their original
names (this rank's pieces) plus each ParallelModule's `_extra_state` (rank, plan and the sharding
metadata). An optimizer state dict of a rank is `optimizer.state_dict()` of an optimizer from
`build_optimizer`: each param group lists the merged names of its parameters under `param_names`,
which is how pieces are matched across ranks, and the top-level entry `nnscaler` records the rank and
plan, which is how it is paired with its model state dict. The checks are in checkpoint_checks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nnscaler.errors import CheckpointError
from nnscaler.runtime.checkpoint.checks import Piece, check_replica, pair_optimizers, read_pieces
from nnscaler.runtime.checkpoint.formats import EXTRA_STATE_KEY, ZERO_SLICES_KEY
from nnscaler.runtime.shard import assemble_shards, local_shape

__all__ = ["merge_state_dicts", "shard_map", "group_names"]

Meta = dict[str, Any]
Held = tuple[int, Any]
"""`(rank, value)`: a value and the rank it came from."""


@dataclass
class _OptPiece:
    """One rank's optimizer state dict, with the sharding of its model's tensors by full name."""

    opt: Mapping[str, Any]
    shards: dict[str, Meta]
    rank: int


def shard_map(metas: Mapping[str, Meta]) -> dict[str, Meta]:
    """Full key -> fullmap entry of every tensor of the ParallelModules (prefix -> extra state)."""
    return {prefix + name: m for prefix, meta in metas.items() for name, m in meta["fullmap"].items()}


def group_names(opt_sd: Mapping[str, Any]) -> list[list[str]]:
    """The merged names of the parameters of each param group of an optimizer state dict."""
    groups = opt_sd["param_groups"]
    if any("param_names" not in g for g in groups):
        raise ValueError(
            "optimizer state dict has no param_names: build the optimizer with build_optimizer or save it "
            "with nnscaler.runtime.optimizer.optimizer_state_dict(module, optimizer)"
        )
    return [list(g["param_names"]) for g in groups]


def _layout(m: Meta) -> tuple[Any, ...]:
    if m["shard"] is None:
        return (tuple(m["full_shape"]), None)
    dim, _, ways, blocks = m["shard"]
    return (tuple(m["full_shape"]), dim, ways, blocks)


def _assemble(what: str, parts: dict[int, Held], m: Meta, hint: str) -> torch.Tensor:
    dim, _, ways, blocks = m["shard"]
    missing = sorted(set(range(ways)) - set(parts))
    if missing:
        holders = ", ".join(f"piece {i} from rank {r}" for i, (r, _) in sorted(parts.items()))
        raise CheckpointError(
            f"merge_state_dicts: {what}: missing pieces {missing} of {ways} (given: {holders}); {hint}"
        )
    try:
        return assemble_shards({i: v for i, (_, v) in parts.items()}, m["full_shape"], dim, ways, blocks)
    except ValueError as err:
        raise CheckpointError(f"merge_state_dicts: {what}: {err}") from None


def _replica_hint(pieces: Sequence[Piece]) -> str:
    ngpus = max(int(m["plan_ngpus"]) for p in pieces for m in p.metas.values())
    return (
        f"the ranks given are {sorted(p.rank for p in pieces)}: pass the state dicts of every rank of one "
        f"data-parallel replica (e.g. ranks 0 to {ngpus - 1}; the plan spans {ngpus} devices)"
    )


def merge_state_dicts(
    module_state_dicts: Sequence[Mapping[str, Any]],
    optimizer_state_dicts: Sequence[Mapping[str, Any]] | None = None,
    *,
    check_replicas: bool = True,
) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Rebuild the single-device model (and optimizer) state dicts from per-rank ones.

    Give the state dicts of all ranks of at least one data-parallel replica (any order; extra ranks
    are fine), and, for the optimizer, the state dict of each of those ranks (any order: each is
    paired with its model state dict by the rank it records). Tied weights appear under every name.
    Optimizer states whose tensors have the parameter's shape (SGD momentum, Adam, AdamW, ...) are
    merged; scalar states (`step`) are copied. The fp32 master weights of the mixed-precision
    optimizers are such a state (`"fp32_params"`, MASTER_KEY of nnscaler.runtime.grads.mixed_precision):
    `merged_optimizer["state"][i]["fp32_params"]` is parameter i's.

    Raises `CheckpointError` (a ValueError) when a state dict lacks its metadata (e.g. saved through
    safetensors), when the pieces come from different plans or twice from one rank, when an
    optimizer state dict has no partner, when a piece is missing, and (`check_replicas`) when two
    ranks' copies of one piece differ beyond rtol 1e-5, atol 1e-6 (exactly, for non-float tensors);
    `check_replicas=False` takes the lowest rank's copy.

    Parameter order of the merged optimizer state: group by group, each parameter in the order the
    ranks list it (ranks ascending), i.e. the order in which the generated module registers them with
    `add_shard`. That is the single-device optimizer's order over `original_model.parameters()` when
    the generated code registers parameters in the original `state_dict()` order (the compiler's
    contract); each merged group also carries `param_names`, and `load_merged_state_dict` uses those
    names, so loading back is exact even when the order differs.
    """
    pieces = sorted(read_pieces(module_state_dicts), key=lambda p: p.rank)
    hint = _replica_hint(pieces)
    merged = _merge_model([(p, module_state_dicts[p.index]) for p in pieces], check_replicas, hint)
    if optimizer_state_dicts is None:
        return merged, None
    opts = pair_optimizers(pieces, optimizer_state_dicts)
    ranks = [_OptPiece(opt, shard_map(p.metas), p.rank) for p, opt in zip(pieces, opts)]
    return merged, _merge_optimizer(_join_zero_slices(ranks, check_replicas), check_replicas, hint)


def _merge_model(pieces: Sequence[tuple[Piece, Mapping[str, Any]]], check: bool, hint: str) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    held: dict[str, Held] = {}
    parts: dict[str, dict[int, Held]] = {}
    specs: dict[str, tuple[int, Meta]] = {}
    aliases: dict[str, str] = {}
    for piece, sd in pieces:
        shards = shard_map(piece.metas)
        aliases.update({p + a: p + o for p, meta in piece.metas.items() for a, o in meta["aliases"].items()})
        for key, value in sd.items():
            if key.endswith(EXTRA_STATE_KEY) and key[: -len(EXTRA_STATE_KEY)] in piece.metas:
                continue
            m = shards.get(key)
            first = specs.setdefault(key, (piece.rank, m)) if m is not None else None
            if first is not None and _layout(first[1]) != _layout(m):
                raise CheckpointError(
                    f"merge_state_dicts: ranks {first[0]} and {piece.rank} disagree on the full shape or "
                    f"sharding of {key}: {_layout(first[1])} vs {_layout(m)} (full shape, dim, ways, blocks)"
                )
            if m is None or m["shard"] is None:
                if key not in held:
                    merged[key], held[key] = value, (piece.rank, value)
                elif check:
                    check_replica(key, held[key], (piece.rank, value))
                continue
            merged.setdefault(key, None)
            got, index = parts.setdefault(key, {}), m["shard"][1]
            if index not in got:
                got[index] = (piece.rank, value)
            elif check:
                check_replica(f"{key} (piece {index} of {m['shard'][2]})", got[index], (piece.rank, value))
    for key, got in parts.items():
        merged[key] = _assemble(key, got, specs[key][1], hint)
    for alias, original in aliases.items():
        if original in merged:
            merged[alias] = merged[original]
    return merged


def _join_zero_slices(ranks: Sequence[_OptPiece], check: bool) -> list[_OptPiece]:
    """ZeRO optimizer state dicts hold slices of each flattened local tensor (param group key
    `zero_slices`); join the slices of all ranks so each rank's state holds whole local tensors."""
    if not any(ZERO_SLICES_KEY in g for r in ranks for g in r.opt["param_groups"]):
        return list(ranks)
    pieces: dict[tuple[str, Any, str], dict[int, tuple[int, int, torch.Tensor]]] = {}
    scalars: dict[tuple[str, Any], dict[str, Held]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    listed = []
    for r in ranks:
        names = [n for group in group_names(r.opt) for n in group]
        slices = [s for g in r.opt["param_groups"] for s in g.get(ZERO_SLICES_KEY, [None] * len(g["params"]))]
        keys = []
        for name, sl in zip(names, slices):
            m = r.shards.get(name)
            if sl is None or m is None:
                keys.append(None)
                continue
            shapes[name] = local_shape(m["full_shape"], m["shard"])
            keys.append((name, None if m["shard"] is None else m["shard"][1]))
        listed.append(keys)
        for idx, state in r.opt["state"].items():
            key, sl = keys[int(idx)], slices[int(idx)]
            if key is None:
                continue
            for skey, value in state.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    got = pieces.setdefault((*key, skey), {})
                    if sl[0] not in got:
                        got[sl[0]] = (r.rank, sl[1], value)
                    elif check:
                        what = f"optimizer state {skey!r} of {key[0]} (ZeRO slice {list(sl)})"
                        check_replica(what, (got[sl[0]][0], got[sl[0]][2]), (r.rank, value))
                    continue
                same = scalars.setdefault(key, {})
                if skey not in same:
                    same[skey] = (r.rank, value)
                elif check:
                    check_replica(f"optimizer state {skey!r} of {key[0]}", same[skey], (r.rank, value))
    joined: dict[tuple[str, Any], dict[str, Any]] = {
        k: {s: v for s, (_, v) in held.items()} for k, held in scalars.items()
    }
    for (name, index, skey), parts in pieces.items():
        numel, at, chunks = math.prod(shapes[name]), 0, []
        for start in sorted(parts):
            _, end, value = parts[start]
            if start != at:
                break
            chunks.append(value.reshape(-1))
            at = end
        if at != numel:
            raise CheckpointError(
                f"merge_state_dicts: optimizer state {skey!r} of {name} lacks ZeRO slices from element {at} "
                f"of {numel}; pass the state dicts of every rank of a ZeRO group"
            )
        joined.setdefault((name, index), {})[skey] = torch.cat(chunks).view(shapes[name])
    out = []
    for r, keys in zip(ranks, listed):
        state = {i: s for i, s in r.opt["state"].items() if keys[int(i)] is None}
        state.update({i: joined[k] for i, k in enumerate(keys) if k is not None and k in joined})
        groups = [{k: v for k, v in g.items() if k != ZERO_SLICES_KEY} for g in r.opt["param_groups"]]
        out.append(_OptPiece({"state": state, "param_groups": groups}, r.shards, r.rank))
    return out


def _merge_optimizer(ranks: Sequence[_OptPiece], check: bool, hint: str) -> dict[str, Any]:
    ngroups = {len(r.opt["param_groups"]) for r in ranks}
    if len(ngroups) != 1:
        raise CheckpointError(
            f"merge_state_dicts: ranks' optimizers have different numbers of param groups {ngroups}"
        )
    merged_names: list[list[str]] = [[] for _ in range(ngroups.pop())]
    for r in ranks:
        for names_so_far, names in zip(merged_names, group_names(r.opt)):
            names_so_far.extend(n for n in names if n not in names_so_far)
    index = {n: j for j, n in enumerate(n for names in merged_names for n in names)}
    state: dict[int, dict[str, Any]] = {}
    held: dict[tuple[int, str], Held] = {}
    pieces: dict[tuple[int, str], dict[int, Held]] = {}
    specs: dict[int, Meta] = {}
    for r in ranks:
        flat = [n for names in group_names(r.opt) for n in names]
        for local_idx, local_state in r.opt["state"].items():
            name = flat[int(local_idx)]
            j, m = index[name], r.shards.get(name)
            entry = state.setdefault(j, {})
            for skey, value in local_state.items():
                sharded = m is not None and m["shard"] is not None
                if not (sharded and isinstance(value, torch.Tensor) and value.dim() > 0):
                    if (j, skey) not in held:
                        entry[skey], held[(j, skey)] = value, (r.rank, value)
                    elif check:
                        check_replica(f"optimizer state {skey!r} of {name}", held[(j, skey)], (r.rank, value))
                    continue
                dim, piece, ways, _ = m["shard"]
                want = list(m["full_shape"])
                want[dim] //= ways
                if list(value.shape) != want:
                    raise NotImplementedError(
                        f"merge_state_dicts: optimizer state {skey!r} of {name} has shape {list(value.shape)}, "
                        f"not the parameter's local shape {want}; only per-element states can be merged"
                    )
                entry.setdefault(skey, None)
                specs[j] = m
                got = pieces.setdefault((j, skey), {})
                if piece not in got:
                    got[piece] = (r.rank, value)
                elif check:
                    what = f"optimizer state {skey!r} of {name} (piece {piece} of {ways})"
                    check_replica(what, got[piece], (r.rank, value))
    names_by_index = {j: n for n, j in index.items()}
    for (j, skey), parts in pieces.items():
        state[j][skey] = _assemble(f"optimizer state {skey!r} of {names_by_index[j]}", parts, specs[j], hint)
    param_groups = []
    for g, names in enumerate(merged_names):
        base = dict(ranks[0].opt["param_groups"][g])
        base["params"] = [index[n] for n in names]
        base["param_names"] = list(names)
        param_groups.append(base)
    return {"state": dict(sorted(state.items())), "param_groups": param_groups}
