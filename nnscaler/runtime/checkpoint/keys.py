"""Which keys of a merged (single-device) state dict a module takes, and what a load skips.

`load_merged_state_dict` reports missing and unexpected keys as torch's `load_state_dict` does: with
`strict` it raises naming them, without it warns and returns them. A state dict of which no key
matches is always an error (the wrong dict, or names with a prefix such as 'module.'), with a hint.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from nnscaler.runtime.checkpoint.formats import EXTRA_STATE_FORMAT, EXTRA_STATE_KEY
from nnscaler.runtime.module import ParallelModule

__all__ = ["ModuleKeys", "module_keys", "check_load_keys"]

_SHOWN = 20
"""At most this many keys are listed in a message."""


@dataclass
class ModuleKeys:
    """The names a module accepts in a merged state dict."""

    tensors: list[list[str]] = field(default_factory=list)
    """The names of each persistent tensor (several for a tied one); missing if none is given."""
    accepted: set[str] = field(default_factory=set)
    """Every name it takes (non-persistent buffers and tied names included)."""


def _non_persistent(module: nn.Module) -> set[str]:
    return {
        f"{prefix}.{name}" if prefix else name
        for prefix, sub in module.named_modules()
        for name in getattr(sub, "_non_persistent_buffers_set", ())
    }


def module_keys(module: nn.Module) -> ModuleKeys:
    """The names of `module`'s tensors in a merged state dict: ParallelModules' original names and
    aliases under their prefix, and the tensors outside them under their own names."""
    keys = ModuleKeys()
    inner: set[int] = set()
    for name, pm in module.named_modules():
        if not isinstance(pm, ParallelModule):
            continue
        prefix = f"{name}." if name else ""
        inner.update(id(t) for t in [*pm.parameters(), *pm.buffers()])
        for info in pm.fullmap.values():
            names = [prefix + n for n in pm._names_of(info)]
            keys.accepted.update(names)
            if info.persistent:
                keys.tensors.append(names)
    skip = _non_persistent(module)
    by_tensor: dict[int, list[str]] = {}
    for name, t in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]:
        if id(t) in inner:
            continue
        keys.accepted.add(name)
        if name not in skip:
            by_tensor.setdefault(id(t), []).append(name)
    keys.tensors.extend(by_tensor.values())
    return keys


def _shown(keys: list[str]) -> str:
    more = f" and {len(keys) - _SHOWN} more" if len(keys) > _SHOWN else ""
    return f"{keys[:_SHOWN]}{more}"


def _prefixes(keys: Iterable[str], targets: set[str]) -> Counter[str]:
    """How often each leading part ('module.') of `keys` is all that keeps a key from being in `targets`."""
    found: Counter[str] = Counter()
    for key in keys:
        parts = key.split(".")
        for i in range(1, len(parts)):
            if ".".join(parts[i:]) in targets:
                found[".".join(parts[:i]) + "."] += 1
                break
    return found


def _prefix_hint(accepted: set[str], given: Iterable[str]) -> str:
    """A prefix to strip from (or add to) the given keys that would make them match, if any."""
    given = list(given)
    strip = _prefixes(given, accepted)  # given "module.fc.weight", accepted "fc.weight"
    add = _prefixes(accepted, set(given))  # given "fc.weight", accepted "body.fc.weight"
    best_strip = strip.most_common(1)[0] if strip else None
    best_add = add.most_common(1)[0] if add else None
    if best_strip is not None and (best_add is None or best_strip[1] >= best_add[1]):
        p = best_strip[0]
        return (
            f"; its keys start with {p!r}, the module's names do not: strip it, e.g. "
            f"{{k.removeprefix({p!r}): v for k, v in state_dict.items()}}"
        )
    if best_add is not None:
        p = best_add[0]
        return (
            f"; the module's names start with {p!r}, its keys do not: add it, or load into the "
            "sub-module they belong to"
        )
    return ""


def check_load_keys(
    keys: ModuleKeys, state_dict: Mapping[str, Any], strict: bool
) -> tuple[list[str], list[str]]:
    """`(missing, unexpected)` keys of loading `state_dict`; raise (strict, or nothing matches) or warn."""
    pieces = {k: v for k, v in state_dict.items() if k.endswith(EXTRA_STATE_KEY) and _is_piece_meta(v)}
    sharded = [k for k, v in pieces.items() if any(e.get("shard") for e in v.get("fullmap", {}).values())]
    if sharded:
        raise RuntimeError(
            f"load_merged_state_dict: the state dict holds the metadata of a sharded ParallelModule "
            f"({sharded[0]!r}): it is one rank's state dict, not a merged one; merge the ranks' state dicts "
            "with merge_state_dicts first, or load it on the same rank and plan with load_sharded_state_dict"
        )
    given = [k for k in state_dict if k not in pieces]  # a rank's metadata over whole tensors: ignored
    missing = [names[0] for names in keys.tensors if not any(n in state_dict for n in names)]
    unexpected = [k for k in given if k not in keys.accepted]
    if keys.accepted and len(unexpected) == len(given):
        if not given:
            raise RuntimeError("load_merged_state_dict: the state dict is empty; nothing would be loaded")
        raise RuntimeError(
            f"load_merged_state_dict: none of the {len(given)} keys of the state dict match the module's "
            f"tensors (e.g. {given[0]!r}; the module's names are like {sorted(keys.accepted)[0]!r}), so "
            f"nothing would be loaded, whatever strict says{_prefix_hint(keys.accepted, given)}"
        )
    if strict and (missing or unexpected):
        raise RuntimeError(
            f"load_merged_state_dict: missing keys {_shown(missing)}, unexpected keys {_shown(unexpected)}; "
            "pass strict=False to load the matching ones"
        )
    if missing or unexpected:
        warnings.warn(
            f"load_merged_state_dict(strict=False): {len(missing)} missing keys (left as they were): "
            f"{_shown(missing)}; {len(unexpected)} unexpected keys (ignored): {_shown(unexpected)}",
            stacklevel=3,
        )
    return missing, unexpected


def _is_piece_meta(value: Any) -> bool:
    return isinstance(value, dict) and value.get("format") == EXTRA_STATE_FORMAT
