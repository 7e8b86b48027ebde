"""parallelize(load_module=True, init_module_params=True) needs weights to load: a module on the meta
device has none, and the ParallelModule would keep uninitialised memory (NaN outputs) without a word.

`refuse_meta_weights` raises in that case, alike on every rank: with `init_params_sync='broadcast'`
over several ranks the weights come from rank 0, so only rank 0's module must be materialised;
otherwise every rank loads its own, so every rank's must be.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from nnscaler.errors import ConfigError
from nnscaler.runtime.device import is_initialized

__all__ = ["meta_tensor_names", "refuse_meta_weights"]


def meta_tensor_names(module: nn.Module) -> list[str]:
    """Names of the module's parameters and buffers on the meta device (no storage)."""
    tensors = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    return [name for name, t in tensors if t.is_meta]


def refuse_meta_weights(module: nn.Module, init_params_sync: str, wanted: bool = True) -> str:
    """Raise when the ranks that provide the weights hold meta tensors. A collective (one small
    all-gather) when the default process group has several ranks: every rank calls it, `wanted` its
    init_module_params. Returns the init_params_sync to load with: as given when every rank wants the
    weights; 'none' when some do not (nnScaler 0.8 allows that: broadcast_weights fills them later), so
    that each rank that does loads its own and no rank waits for the others."""
    mine = meta_tensor_names(module) if wanted else []
    shown = mine[:3] + (["..."] if len(mine) > 3 else [])
    if is_initialized() and dist.get_world_size() > 1:
        everyone: list[tuple[bool, list[str]] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (wanted, shown))
        wants = [w for w, _ in everyone]  # type: ignore[misc]
        all_want = all(wants)
        sources = [0] if init_params_sync == "broadcast" and all_want else range(len(everyone))
        bad = {r: everyone[r][1] for r in sources if everyone[r][1]}  # type: ignore[index]
    else:
        all_want, bad = wanted, ({0: shown} if mine else {})
    if not bad:
        return init_params_sync if all_want else "none"
    where = "; ".join(f"rank {r}: {names}" for r, names in bad.items())
    raise ConfigError(
        f"parallelize: the module's weights are on the meta device ({where}), so the ParallelModule would "
        "keep uninitialised weights. Materialise them (e.g. module.to_empty(device=...) and initialise them, "
        "or build the module outside torch.device('meta')), or pass init_module_params=False and load a "
        "checkpoint with load_merged_state_dict"
    )
