"""Loading the constants of generated code: tensors the forward makes from literals (`torch.tensor([...])`)
or reads from plain tensor attributes, which torch.export lifts out of the graph.

The compiler saves their values once, in `constants.pt` beside the generated files. A rank's code
registers as non-persistent buffers only the constants it uses (a pipeline stage, those of its own
stages) and names in `constant_users` every constant any rank uses, with its users. The file is the
same for every rank (its sha256 is checked against rank 0's record before a rank imports its code),
so every rank checks that it holds all of them: a missing file or key fails on every rank alike, with
the file, the key and the stages and ranks using it named, instead of failing on the ranks that use
it while the others wait for them in their first collective.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any, Protocol

import torch

from nnscaler.errors import ConfigError
from nnscaler.runtime.shard import shard_slice


class ParallelModule(Protocol):
    """What loading constants needs of a ParallelModule (nnscaler.runtime.module, which imports this
    module; its class attributes `constants_file` and `constant_users` are read from the type)."""

    rank: int
    fullmap: Mapping[str, Any]

    def _names_of(self, info: Any) -> list[str]: ...

    def _write(self, local: str, value: torch.Tensor) -> None: ...


__all__ = ["constants_path", "read_constants", "load_constants"]

_FIX = (
    "Regenerate the code (parallelize with reuse='moo' or 'override'), or give every rank the whole output "
    "directory (broadcast_strategy='code' sends rank 0's files to ranks without a shared disk)"
)


def constants_path(module: ParallelModule) -> str | None:
    """Where the module's `constants_file` is (relative paths are beside the generated file)."""
    path = type(module).constants_file
    if path is None:
        return None
    module_file = getattr(sys.modules.get(type(module).__module__), "__file__", None)
    if not os.path.isabs(path) and module_file:
        path = os.path.join(os.path.dirname(module_file), path)
    return path


def _who(module: ParallelModule) -> str:
    return f"{type(module).__name__} of rank {module.rank}"


def read_constants(module: ParallelModule, users: Mapping[str, str]) -> Mapping[str, torch.Tensor]:
    """The module's constants file (memory-mapped); ConfigError naming the file when it is missing or
    unreadable, or naming each key of `users` it lacks and who uses that key."""
    path = constants_path(module)
    what = f"the values of the tensors the forward makes from literals ({', '.join(map(repr, users))})"
    if path is None or not os.path.exists(path):
        raise ConfigError(f"{_who(module)}: the constants file {path} is missing; it holds {what}. {_FIX}")
    try:
        data = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # noqa: BLE001  (a damaged or foreign file: pickle, zip or mmap errors)
        raise ConfigError(
            f"{_who(module)}: the constants file {path} cannot be read ({type(exc).__name__}: {exc}); it holds "
            f"{what}. {_FIX}"
        ) from exc
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{_who(module)}: the constants file {path} holds a {type(data).__name__}, not a dict of tensors. {_FIX}"
        )
    missing = [k for k in users if not isinstance(data.get(k), torch.Tensor)]
    if missing:
        lacks = "; ".join(f"{k!r}, used by {users[k]}" for k in missing)
        held = sorted(map(str, data))
        raise ConfigError(
            f"{_who(module)}: the constants file {path} lacks {lacks} (it holds {held[:8]}"
            f"{' ...' if len(held) > 8 else ''}): it is not the file this code was generated with. {_FIX}"
        )
    return data


def load_constants(module: ParallelModule) -> set[str]:
    """Fill the module's registered constants from its constants file; returns their original names.

    With `constant_users` (generated code) only those keys are looked at, and every one must be in the
    file (see the module docstring); without it (hand-written modules) every registered tensor the file
    holds is loaded."""
    if type(module).constants_file is None:
        return set()
    users = type(module).constant_users
    data = read_constants(module, users or {})
    wanted = set(users) if users is not None else set(data)
    loaded: set[str] = set()
    with torch.no_grad():
        for local, info in module.fullmap.items():
            key = next((n for n in module._names_of(info) if n in wanted and n in data), None)
            if key is None:
                continue
            full = data[key]
            if tuple(full.shape) != info.full_shape:
                raise ConfigError(
                    f"{_who(module)}: the constants file {constants_path(module)} holds {key!r} with shape "
                    f"{list(full.shape)}, but the code registers it with shape {list(info.full_shape)}. {_FIX}"
                )
            module._write(local, shard_slice(full, info.shard))
            loaded.add(info.original_name)
    return loaded
