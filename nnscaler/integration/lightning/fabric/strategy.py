"""NnScalerFabricStrategy: Lightning Fabric with a module compiled by nnscaler.

`fabric.setup(model, optimizer)` parallelizes `model` (`nnscaler.parallelize`, traced with the
strategy's `dummy_forward_args` or the module's own attribute), moves its weights into the parallel
module (the model's weight-holding submodules become None, `model.nnscaler_module` is the parallel
module and `model(...)` runs it) and sets the optimizer up over this rank's shards (under ZeRO, its
slices: nnscaler.integration.lightning.optimizers). Processes, launching and collectives are Fabric's
DDP machinery (gloo on CPU, NCCL on CUDA); `fabric.save` / `fabric.load` write and read one file per
rank in a directory (as NnScalerStrategy), `merge_checkpoint` makes one single-device checkpoint.
With a pipeline (`use_end2end=True`, e.g. the 'pp' or 'hybrid' policy) `model(...)` runs the whole
schedule, forward and backward (nnscaler.integration.lightning.fabric.pipeline).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.fabric.strategies import DDPStrategy
from torch import nn

import nnscaler
from nnscaler.config import ComputeConfig
from nnscaler.errors import ConfigError
from nnscaler.integration.lightning.fabric.checkpoint import load_into, merge_fabric_checkpoint
from nnscaler.integration.lightning.fabric.pipeline import PipelinedCall
from nnscaler.integration.lightning.optimizers import nnscaler_optimizer
from nnscaler.integration.lightning.pytorch.checkpoint import read_rank_checkpoint, write_rank_checkpoint
from nnscaler.integration.lightning.replicas import ReplicaRanks
from nnscaler.runtime.dist.groups import create_groups, get_group
from nnscaler.runtime.module import ParallelModule

__all__ = ["NnScalerFabricStrategy"]


def adopt(module: nn.Module, pm: ParallelModule, call: nn.Module) -> None:
    """Move `module`'s weights out (they live in `pm` now) and route its calls to `call`."""
    for name, child in list(module.named_children()):
        if any(True for _ in child.parameters()) or any(True for _ in child.buffers()):
            setattr(module, name, None)
    for name in list(module._parameters):
        module.register_parameter(name, None)
    module.nnscaler_module = pm
    object.__setattr__(module, "forward", call)  # not a submodule: its weights are nnscaler_module's


class NnScalerFabricStrategy(ReplicaRanks, DDPStrategy):
    """`compute_config`, `pas_policy` as for `nnscaler.parallelize`; `dummy_forward_args`: a dict of
    forward arguments to trace with (default: the model's `dummy_forward_args` attribute); further
    keywords go to `nnscaler.parallelize`."""

    strategy_name = "nnscaler"

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Any = None,
        *,
        compute_config: ComputeConfig | None = None,
        pas_policy: str | Callable | None = None,
        dummy_forward_args: dict[str, Any] | None = None,
        gen_savedir: str | os.PathLike = "./.nnscaler",
        reuse: str = "match",
        instance_name: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not isinstance(compute_config, ComputeConfig):
            raise ConfigError(
                "NnScalerFabricStrategy needs compute_config=ComputeConfig(plan_ngpus, runtime_ngpus)"
            )
        if pas_policy is None:
            raise ConfigError("NnScalerFabricStrategy needs pas_policy (e.g. 'dp', 'tp', 'autodist')")
        backend = kwargs.pop("process_group_backend", None)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=backend,
        )
        self.compute_config = compute_config
        self.pas_policy = pas_policy
        self.dummy_forward_args = dummy_forward_args
        self._parallelize_kwargs = {
            "gen_savedir": gen_savedir,
            "reuse": reuse,
            "instance_name": instance_name,
        }
        self._parallelize_kwargs.update(kwargs)
        self.parallel_module: ParallelModule | None = None
        self.pipelined: PipelinedCall | None = None
        """With a pipeline: what `fabric.setup` returned as the model (its calls run the schedule)."""

    # -- processes -------------------------------------------------------------------------------

    def _set_world_ranks(self) -> None:
        super()._set_world_ranks()
        self._check_world("NnScalerFabricStrategy", "Fabric")

    def setup_environment(self) -> None:
        super().setup_environment()
        nnscaler.init()
        create_groups(self._replica_groups())

    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Over the data-parallel replicas only: the ranks of one plan hold the same value."""
        if group is not None or not isinstance(tensor, torch.Tensor):
            return super().all_reduce(tensor, group, reduce_op)
        ranks = self._my_replica_ranks()
        return tensor if len(ranks) == 1 else super().all_reduce(tensor, get_group(ranks), reduce_op)

    # -- module and optimizers -------------------------------------------------------------------------

    def setup_module(self, module: nn.Module) -> nn.Module:
        if self.parallel_module is not None:
            raise ConfigError("NnScalerFabricStrategy sets up one model; call fabric.setup once")
        dummy = self.dummy_forward_args or getattr(module, "dummy_forward_args", None)
        if not isinstance(dummy, dict):
            raise ConfigError(
                f"NnScalerFabricStrategy: give dummy_forward_args=<dict of forward arguments> (or set "
                f"{type(module).__name__}.dummy_forward_args) to trace the model with"
            )
        pm = nnscaler.parallelize(
            module, dummy, self.pas_policy, self.compute_config, **self._parallelize_kwargs
        )
        self.parallel_module = pm
        if not self.compute_config.use_end2end:
            adopt(module, pm, pm)
            return pm
        self.pipelined = PipelinedCall(pm, inspect.signature(module.forward))
        self.backward = self._pipelined_backward  # type: ignore[method-assign]
        adopt(module, pm, self.pipelined)
        return self.pipelined

    def module_to_device(self, module: nn.Module) -> None:
        """The parallel module places its shards itself (nnscaler.runtime.device)."""

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        if self.parallel_module is None:
            raise ConfigError(
                "NnScalerFabricStrategy: set the model up first (fabric.setup(model, optimizer))"
            )
        optimizer = nnscaler_optimizer(self.parallel_module, optimizer, "NnScalerFabricStrategy", rebind=True)
        pipelined = self.pipelined
        if pipelined is not None:
            # the model call already ran backward: gradients are zeroed before the first call after a step
            optimizer.zero_grad = lambda set_to_none=True: None
            optimizer.register_step_post_hook(lambda *args: setattr(pipelined, "grads_stale", True))
        return optimizer

    def _pipelined_backward(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        """`backward` with a pipeline (bound in setup_module, so that only then Fabric also refuses a plain
        `loss.backward()`): the model call ran backward already; accept only the loss it returned."""
        pipelined = self.pipelined
        assert pipelined is not None
        if tensor is not pipelined.last_loss:
            raise ConfigError(
                "NnScalerFabricStrategy with a pipeline (use_end2end=True): `model(...)` runs forward and backward, "
                "so fabric.backward takes the loss it returned, unchanged; compute the whole loss (and any scaling) "
                "inside the model's forward, and use pas_config['pipeline_nmicros'] for gradient accumulation"
            )
        pipelined.last_loss = None

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        """`fabric.no_backward_sync(model)`: accumulate gradients without reducing them (with a pipeline
        every call reduces its own gradients: a no-op)."""
        pm = self.parallel_module
        return pm.no_sync() if enabled and pm is not None and self.pipelined is None else nullcontext()

    def clip_gradients_norm(
        self,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        **_: Any,
    ) -> torch.Tensor:
        """The 2-norm over every shard of every parameter (the optimizer's `clip_gnorm`)."""
        if float(norm_type) != 2.0:
            raise ConfigError(f"NnScalerFabricStrategy clips by the 2-norm only, got norm_type={norm_type}")
        return optimizer.clip_gnorm(float(max_norm))

    # -- checkpoints -------------------------------------------------------------------------------------

    def get_module_state_dict(self, module: nn.Module) -> dict[str, Any]:
        return module.state_dict()

    def save_checkpoint(
        self, path: Any, state: dict[str, Any], storage_options: Any = None, filter: Any = None
    ) -> None:
        """Every rank writes its pieces: `path` is a directory of `rank{r}.ckpt`."""
        write_rank_checkpoint(
            self._convert_stateful_objects_in_state(state, filter or {}), path, self.global_rank
        )

    def load_checkpoint(
        self, path: Any, state: Any = None, strict: bool = True, weights_only: Any = None
    ) -> dict:
        """This rank's file of a `save_checkpoint` directory, restored into `state`'s objects; returns the rest."""
        checkpoint = read_rank_checkpoint(path, self.global_rank, self.world_size)
        return load_into(checkpoint, state, strict)

    @staticmethod
    def merge_checkpoint(checkpoint_dir: Any, output_file: Any) -> None:
        """A `fabric.save` directory -> one file whose model entries have the single-device module's
        names (and whose optimizer entries are merged too); other entries are rank 0's."""
        merge_fabric_checkpoint(checkpoint_dir, output_file)
