"""The batch `dummy_forward_args_fn(batch)` traces with: the first batch of the loop's own data source.

`trainer.fit(model, train_dl, val_dl)` hands the loaders to the fit loop, not to the module, so the
module's `train_dataloader()` may not exist. Lightning records where each loop reads its data in
`loop._data_source` (a `_DataLoaderSource`: the loaders passed to fit, a datamodule, or the module);
it is private API, so it is read guarded (a Lightning without it falls back to the datamodule's or
the module's `train_dataloader()`), and with no source at all the error names what to pass.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden

from nnscaler.errors import ConfigError

__all__ = ["first_batch"]

_STAGE_LOOPS = {  # the loop whose data the running stage reads, after the fit loop's training data
    TrainerFn.VALIDATING: "validate_loop",
    TrainerFn.TESTING: "test_loop",
    TrainerFn.PREDICTING: "predict_loop",
}


def _loop_loaders(trainer: pl.Trainer, loop_name: str) -> Any:
    """The loaders of `trainer.<loop_name>._data_source`, or None where it holds none (or the
    installed Lightning keeps it elsewhere)."""
    source = getattr(getattr(trainer, loop_name, None), "_data_source", None)
    if source is None or getattr(source, "instance", None) is None:
        return None
    try:
        if not source.is_defined():  # a module source without the `*_dataloader` hook
            return None
        return source.dataloader()
    except AttributeError:  # a Lightning whose _DataLoaderSource differs: use the fallbacks
        return None


def _hook_loaders(trainer: pl.Trainer, module: pl.LightningModule) -> Any:
    for owner in (trainer.datamodule, module):
        if owner is not None and is_overridden("train_dataloader", owner):
            return owner.train_dataloader()
    return None


def _first(loaders: Any) -> Any:
    """The first batch, shaped as `training_step` receives it: a list/dict of loaders gives a
    list/dict of their first batches (Lightning's default 'max_size_cycle' combination)."""
    if isinstance(loaders, Mapping):
        return {k: _first(v) for k, v in loaders.items()}
    if isinstance(loaders, (list, tuple)):
        return type(loaders)(_first(v) for v in loaders)
    if not isinstance(loaders, Iterable):
        raise ConfigError(
            f"NnScalerStrategy: the training data source is a {type(loaders).__name__}, not an iterable "
            "of batches; pass a DataLoader (or a list/dict of them) to trainer.fit"
        )
    return next(iter(loaders))


def first_batch(trainer: pl.Trainer, module: pl.LightningModule) -> Any:
    """The first batch of the fit loop's training data (the loaders passed to `trainer.fit`, the
    datamodule's, or the module's `train_dataloader()`); outside fit, of the running stage's loaders.
    Reading it leaves torch's CPU random stream as it was (a DataLoader iterator draws its base seed
    from it), so a run traces without shifting the user's random numbers."""
    candidates = [lambda: _loop_loaders(trainer, "fit_loop")]
    stage = _STAGE_LOOPS.get(getattr(trainer.state, "fn", None))
    if stage is not None:
        candidates.append(lambda: _loop_loaders(trainer, stage))
    candidates.append(lambda: _hook_loaders(trainer, module))
    for candidate in candidates:
        loaders = candidate()
        if loaders is not None:
            with torch.random.fork_rng(devices=[]):
                return _first(loaders)
    raise ConfigError(
        f"NnScalerStrategy: {type(module).__name__}.dummy_forward_args_fn needs a batch, and there is no "
        "training data: pass the loaders to trainer.fit(model, train_dataloaders=...) or a datamodule, "
        f"define {type(module).__name__}.train_dataloader(), or set `dummy_forward_args` (a dict of "
        "forward arguments) on the module"
    )
