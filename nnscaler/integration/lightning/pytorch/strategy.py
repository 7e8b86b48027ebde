"""NnScalerStrategy: Lightning training of a LightningModule compiled by nnscaler.

On setup the strategy parallelizes the LightningModule itself (`nnscaler.parallelize` on its
`forward`, traced with `dummy_forward_args`), moves its weights into the parallel module (the
original submodules become None, so `self.parameters()` in `configure_optimizers` gives the shards),
and routes `self(...)` to the generated code. Process groups, launching and logging are Lightning's
DDP machinery (gloo on CPU, NCCL on CUDA); the data sampler splits batches by data-parallel replica,
so the ranks of one replica read the same batch. With a pipeline (`use_end2end=True`) a call of the
module in training runs the whole schedule, forward and backward, over the batch's micro-batches and
returns their mean loss; in evaluation it runs the forward schedule.
"""

from __future__ import annotations

import os
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn

import nnscaler
from nnscaler.config import ComputeConfig
from nnscaler.errors import ConfigError
from nnscaler.integration.lightning.optimizers import nnscaler_optimizer
from nnscaler.integration.lightning.pytorch.checkpoint import (
    META_KEY,
    merge_checkpoint_files,
    read_rank_checkpoint,
    remove_rank_checkpoint,
    saved_state_dict_type,
    write_rank_checkpoint,
)
from nnscaler.integration.lightning.pytorch.dummy_batch import first_batch
from nnscaler.integration.lightning.pytorch.parallel_forward import ParallelForward
from nnscaler.integration.lightning.replicas import ReplicaRanks
from nnscaler.runtime.checkpoint.save_types import (
    DEDUPED,
    PER_RANK_SAVE_TYPES,
    load_local_state_dicts,
    local_state_dicts,
)
from nnscaler.runtime.dist.groups import create_groups, get_group
from nnscaler.runtime.module import ParallelModule

__all__ = ["NnScalerStrategy"]

STATE_DICT_TYPES = PER_RANK_SAVE_TYPES
"""'sharded' and 'deduped', the runtime's save types of which every rank writes its own file."""


class NnScalerStrategy(ReplicaRanks, DDPStrategy):
    """`compute_config` and `pas_policy` as for `nnscaler.parallelize`; `state_dict_type`:
    'sharded' (every rank saves its pieces) or 'deduped' (one copy of each piece over the
    data-parallel replicas); further keywords go to `nnscaler.parallelize`."""

    strategy_name = "nnscaler"

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        *,
        compute_config: ComputeConfig | None = None,
        state_dict_type: str = "sharded",
        pas_policy: Any = None,
        gen_savedir: str | os.PathLike = "./.nnscaler",
        reuse: str = "match",
        instance_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(compute_config, ComputeConfig):
            raise ConfigError(
                "NnScalerStrategy needs compute_config=ComputeConfig(plan_ngpus, runtime_ngpus)"
            )
        if pas_policy is None:
            raise ConfigError("NnScalerStrategy needs pas_policy (e.g. 'dp', 'tp', 'pp', 'autodist')")
        if state_dict_type not in STATE_DICT_TYPES:
            raise ConfigError(
                f"NnScalerStrategy(state_dict_type={state_dict_type!r}): use one of {list(STATE_DICT_TYPES)}"
            )
        backend = kwargs.pop("process_group_backend", None)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=backend,
        )
        self.compute_config = compute_config
        self.pas_policy = pas_policy
        self.state_dict_type = state_dict_type
        self.gen_savedir = gen_savedir
        self.reuse = reuse
        self.instance_name = instance_name
        self._parallelize_kwargs = kwargs
        self.parallel_module: ParallelModule | None = None

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="nnscaler's parallelized module")

    # -- processes -------------------------------------------------------------------------------

    def set_world_ranks(self) -> None:
        super().set_world_ranks()  # checked here: before the process group is created
        self._check_world("NnScalerStrategy", "Lightning")

    def setup_environment(self) -> None:
        super().setup_environment()
        nnscaler.init()
        create_groups(self._replica_groups())

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """`self.log(..., sync_dist=True)` reduces over the data-parallel replicas only: the ranks of
        one plan hold the same value (the loss is on every rank, pipelines included), so counting
        them all would multiply a sum by plan_ngpus."""
        if group is not None or not isinstance(tensor, torch.Tensor):
            return super().reduce(tensor, group, reduce_op)
        ranks = self._my_replica_ranks()
        if len(ranks) == 1:
            return tensor
        return super().reduce(
            tensor, get_group(ranks), reduce_op
        )  # the process group is up (Lightning's); nnscaler binds its device and state

    # -- the module --------------------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if self.parallel_module is None:
            self._parallelize(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ConfigError(
                    f"NnScalerStrategy supports one optimizer; configure_optimizers returned {len(self.optimizers)}"
                )
            optimizer = nnscaler_optimizer(self.parallel_module, self.optimizers[0], "NnScalerStrategy")
            self.optimizers = [optimizer]  # under ZeRO a ZeroOptimizer stepping the user's on its slices
            if self.compute_config.use_end2end:
                # Lightning zeroes gradients after training_step, where a pipeline has already run its
                # backward: the strategy zeroes them itself, before the first schedule after a step
                optimizer.zero_grad = lambda set_to_none=True: None
                optimizer.register_step_post_hook(lambda *args: self._zero_before_next_schedule())
        self.setup_precision_plugin()

    def _dummy_forward_args(self, trainer: pl.Trainer, module: pl.LightningModule) -> dict[str, Any]:
        if getattr(module, "dummy_forward_args", None) is not None:
            return module.dummy_forward_args
        fn = getattr(module, "dummy_forward_args_fn", None)
        if fn is not None:  # the first batch of the loaders given to fit, or the datamodule's/module's
            return fn(first_batch(trainer, module))
        raise ConfigError(
            f"NnScalerStrategy: {type(module).__name__} needs `dummy_forward_args` (a dict of forward "
            "arguments to trace with) or `dummy_forward_args_fn(batch) -> dict`"
        )

    def _parallelize(self, trainer: pl.Trainer) -> None:
        module = self.lightning_module
        assert module is not None
        dummy = self._dummy_forward_args(trainer, module)
        pm = nnscaler.parallelize(
            module,
            dummy,
            self.pas_policy,
            self.compute_config,
            gen_savedir=self.gen_savedir,
            reuse=self.reuse,
            instance_name=self.instance_name,
            **self._parallelize_kwargs,
        )
        for name, child in list(module.named_children()):  # their weights now live in `pm`
            if any(True for _ in child.parameters()) or any(True for _ in child.buffers()):
                setattr(module, name, None)
        for name in list(module._parameters):
            module.register_parameter(name, None)
        module.nnscaler_module = pm
        self.parallel_module = pm
        self._grads_stale = True
        # an object, not a closure over pm: a deepcopy of the module runs its own copy (parallel_forward.py)
        module.forward = ParallelForward(self, module, self.compute_config.use_end2end)

    def _zero_before_next_schedule(self) -> None:
        self._grads_stale = True

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Gradient accumulation: reduce only on the last micro-batch's backward."""
        pm = self.parallel_module
        with pm.no_sync() if pm is not None and not self.compute_config.use_end2end else nullcontext():
            yield

    # -- checkpoints ---------------------------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        assert self.parallel_module is not None
        return self.parallel_module.state_dict()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.state_dict_type == DEDUPED:
            optimizer = self.optimizers[0] if self.optimizers else None
            model, opt = local_state_dicts(self.parallel_module, optimizer, DEDUPED)
            checkpoint["state_dict"] = model
            checkpoint["optimizer_states"] = [opt] if opt is not None else []
        checkpoint[META_KEY] = {"state_dict_type": self.state_dict_type, "rank": self.global_rank}
        write_rank_checkpoint(checkpoint, filepath, self.global_rank)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        return read_rank_checkpoint(checkpoint_path, self.global_rank, self.world_size)

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        if self.parallel_module is None:  # Lightning restores weights before it sets the strategy up
            self._parallelize(self.lightning_module.trainer)
        if saved_state_dict_type(checkpoint) == DEDUPED:
            load_local_state_dicts(self.parallel_module, DEDUPED, checkpoint["state_dict"])
        else:
            self.parallel_module.load_state_dict(checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint: dict[str, Any]) -> None:
        if saved_state_dict_type(checkpoint) == DEDUPED:
            states = checkpoint["optimizer_states"]
            load_local_state_dicts(
                self.parallel_module,
                DEDUPED,
                checkpoint["state_dict"],
                self.optimizers[0],
                states[0] if states else None,
            )
            return
        super().load_optimizer_state_dict(checkpoint)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.is_global_zero:  # the rank files only: a user's files in the directory stay
            remove_rank_checkpoint(filepath)

    @staticmethod
    def merge_checkpoint(checkpoint_files: list[Any], output_file: Any) -> None:
        """Rank files of one checkpoint (or its directory) -> one single-device Lightning checkpoint."""
        merge_checkpoint_files(checkpoint_files, output_file)


def _register() -> None:
    """`strategy='nnscaler'` names this class (its required arguments still have to be given)."""
    from lightning.pytorch.strategies import StrategyRegistry

    if NnScalerStrategy.strategy_name not in StrategyRegistry:
        NnScalerStrategy.register_strategies(StrategyRegistry)


_register()
