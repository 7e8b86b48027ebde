"""The gradient side of a ParallelModule (mixed into it): the reducer's lifecycle (built on first use
from `compute_config`, rebuilt when the parameters change), `no_sync` / `reducing` / `sync_grad`, and
the gradient norm and clipping over one plan copy."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nnscaler.errors import ConfigError
from nnscaler.runtime.device import runtime_device
from nnscaler.runtime.dist.groups import create_host_groups, get_group, get_host_group
from nnscaler.runtime.grads.autotune import BucketAutotuner
from nnscaler.runtime.grads.fault_inject import refuse_if_set
from nnscaler.runtime.grads.reducer import (
    Reducer,
    build_reducer,
    first_holders,
    grad_sq_norm,
    param_grad,
    scale_grads,
)
from nnscaler.runtime.grads.zero3 import Zero3Reducer, build_zero3
from nnscaler.runtime.module_parts import zeno_scoring

__all__ = ["GradientsMixin"]


class GradientsMixin:
    """Mixed into ParallelModule, whose fields (`fullmap`, `group`, `compute_config`, ...) it uses."""

    _reducer: Reducer | None
    _reducer_built: bool
    _zero3: Zero3Reducer | None
    """ZeRO stage 3 (the reducer, once built): hands out gathered parameters (ParallelModule.__getattr__)."""
    _grads_synced: bool
    _norm_owned: list[bool] | None
    _norm_keys: list | None = None
    """The pieces `_norm_owned` was computed for."""
    _autotune: BucketAutotuner | None = None
    """`reducer_bucket_autotune`: tries bucket sizes over the first steps (runtime/autotune.py)."""
    _retune = False
    """The tuner moved on: rebuild the reducer with its size at the next forward holding no gradients."""
    _step_started: float | None = None
    """When the first forward since the last `sync_grad` began (the tuner times forward to sync)."""
    _zeno_scorer: Callable[[Any], torch.Tensor] | None = None
    """grad_aggregation='zeno': the user's validation loss (`set_zeno_scorer` / `set_zeno_batch`)."""
    _zeno_step_batch: Any = None
    """train_step's default validation micro-batch (its last), for the duration of the step."""
    _grad_groups: dict[str, list[int]] | None = None
    """Local parameter name -> the ranks the reducer sums its gradient over (`reduce_grad_over`)."""

    # ---- training -------------------------------------------------------------------------------------

    def parameters_for_optimizer(self) -> list[nn.Parameter]:
        """The local trainable parameters, in registration order (what `build_optimizer` hands the
        optimizer without ZeRO; under ZeRO it hands it this rank's slices of them, so build it that
        way). Frozen parameters (`requires_grad=False`) are left out: they get no optimizer state."""
        return [p for p in self.parameters() if p.requires_grad]

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._reducer is not None:
            # waits for reductions in flight; drops the bucket views (set_to_none) or zeroes them
            self._reducer.zero_grad(set_to_none)
        super().zero_grad(set_to_none=set_to_none)
        self._grads_synced = False

    # ---- gradient reducer ---------------------------------------------------------------------------

    def reduce_grad_over(self, local_name: str, ranks: Sequence[int]) -> None:
        """Generated code calls this: `local_name` is held whole along plan axes where every reader splits
        the batch, so its gradient is a partial sum there. The reducer sums it over `ranks` (this rank's
        ranks on those axes, in every data-parallel replica), dividing by the replicas as for any weight:
        the sum over the axes, then the replicas' mean (or sum, `dp_grad_reduction='sum'`)."""
        if local_name not in self.fullmap:
            raise KeyError(f"reduce_grad_over: {local_name!r} is not registered (call add_shard first)")
        ranks = sorted(int(r) for r in ranks)
        if not set(self._dp_ranks()) <= set(ranks):
            raise ValueError(
                f"reduce_grad_over({local_name!r}, {ranks}): the group must hold this rank's data-parallel "
                f"group {self._dp_ranks()}"
            )
        self._grad_groups = {**(self._grad_groups or {}), local_name: ranks}

    @property
    def reducer(self) -> Reducer | None:
        """The gradient reducer over the "dp" group (None with one replica); built on first use from
        `compute_config` (`reducer_bucket_cap_mb`, `use_async_reducer`, `use_zero`, `zero_ngroups`,
        `zero_use_reduce_scatter`; defaults when it is None)."""
        return self._ensure_reducer()

    def _ensure_reducer(self) -> Reducer | None:
        red = self._reducer
        if self._retune and not self._holds_grads():
            self._retune = False
            self._drop_reducer()
            red = None
        if red is not None and not red.valid_for(self.parameters_for_optimizer()):
            if red.zero:
                red.check()
                if {id(p) for p in self.parameters_for_optimizer()} != {id(p) for p in red.params}:
                    raise RuntimeError(
                        f"{type(self).__name__}: a parameter was frozen or unfrozen (requires_grad changed) "
                        "after the ZeRO reducer was built; set requires_grad before parallelize"
                    )
                raise RuntimeError(
                    f"{type(self).__name__}: parameters were replaced after the ZeRO reducer was built"
                )
            self._drop_reducer()
        if not self._reducer_built:
            self._reducer = self._build_reducer()
            self._reducer_built = True
            self._zero3 = self._reducer if isinstance(self._reducer, Zero3Reducer) else None
        return self._reducer

    def _drop_reducer(self) -> None:
        if self._reducer is not None:
            self._reducer.zero_grad()
            self._reducer.remove_hooks()
        self._reducer, self._reducer_built, self._zero3 = None, False, None

    def _holds_grads(self) -> bool:
        return any(p.grad is not None or getattr(p, "main_grad", None) is not None for p in self.parameters())

    def _build_reducer(self) -> Reducer | None:
        if self.inference_only:  # nothing to reduce: no parameter requires a gradient
            return None
        cfg = self.compute_config
        if getattr(cfg, "grad_aggregation", "mean") != "mean" and getattr(self, "use_scheduler", False):
            raise ConfigError(
                f"ComputeConfig.grad_aggregation={cfg.grad_aggregation!r} is not supported with pipeline "
                "stages yet: use grad_aggregation='mean', or a plan without pipeline stages"
            )
        zero3 = cfg is not None and cfg.use_zero and getattr(cfg, "zero_stage", 1) == 3
        if self._grad_groups and (self.group("dp") is None or zero3):
            raise ConfigError(
                f"{type(self).__name__} sums some gradients over plan axes in its reducer (reduce_grad_over), "
                "which needs data-parallel replicas and not ZeRO 3: generate it again for this ComputeConfig"
            )
        if cfg is not None and cfg.use_zero and getattr(cfg, "zero_stage", 1) == 3:
            refuse_if_set("ZeRO stage 3 has no fault drill: run it with zero_stage 1 or 2")
            return build_zero3(self)
        cap = None
        if getattr(cfg, "reducer_bucket_autotune", False) and self.group("dp") is not None:
            if self._autotune is None:
                self._autotune = BucketAutotuner()
            create_host_groups(self.dims.dp_groups())  # the tuner agrees on CPU tensors (cached)
            cap = self._autotune.current_mb
        return build_reducer(
            self.parameters_for_optimizer(),
            self.group("dp"),
            bucket_cap_mb=cap,
            rank=self.rank,
            world_size=self.world_size,
            plan_ngpus=self.plan_ngpus,
            config=self.compute_config,
            deferred=self.tied_params(),  # summed over the stages first (sync_tied_grads)
            groups=self._grad_group_map(),
        )

    def _grad_group_map(self) -> dict[int, dist.ProcessGroup]:
        """id of each trainable parameter of `reduce_grad_over` -> its group (created at init)."""
        out = {}
        for name, ranks in (self._grad_groups or {}).items():
            param, group = self._tensor(name), get_group(ranks)
            if param.requires_grad and group is not None:
                out[id(param)] = group
        return out

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Inside: backward accumulates gradients locally without launching reductions (gradient
        accumulation); the next `sync_grad` (or the optimizer step) reduces the sum once."""
        red = self._ensure_reducer()
        old = red.enabled if red is not None else True
        if red is not None:
            red.enabled = False
        try:
            yield
        finally:
            if red is not None:
                red.enabled = old

    @contextmanager
    def reducing(self) -> Iterator[None]:
        """Inside (even within `no_sync`): backward launches each bucket's reduction as soon as it is
        full. `train_step` uses it for the last micro-batch, so its reductions overlap its backward."""
        red = self._ensure_reducer()
        if red is None:
            yield
            return
        old = red.enabled, red.settle_after_backward, red.last_backward
        red.enabled, red.settle_after_backward = True, False  # the step's final sync_grad waits
        red.last_backward = True  # the gradient is final: reducer hooks need not defer the reductions
        try:
            yield
        finally:
            red.enabled, red.settle_after_backward, red.last_backward = old

    def sync_grad(self) -> None:
        """Average gradients over the data-parallel group ("dp"): wait for the reductions the backward
        hooks launched (`use_async_reducer`) and reduce the remaining buckets."""
        red = self._ensure_reducer()
        if red is not None:
            zeno_scoring.attach(self, red)  # grad_aggregation='zeno': the validation loss it scores with
            red.sync()
        self._grads_synced = True
        self._tune_step()

    def set_zeno_scorer(self, fn: Callable[[Any], torch.Tensor] | None) -> None:
        """grad_aggregation='zeno': `fn(module)` returns the validation loss of `module` as it is (it runs
        the forward; called twice per step, without grad and in eval mode, the second time at x - gamma * g).
        Every rank of a replica must compute the same loss. None: train_step's default (its last
        micro-batch). Needed when gradients are synced outside train_step (plain backward + step)."""
        self._zeno_scorer = fn

    def set_zeno_batch(self, batch: Any) -> None:
        """grad_aggregation='zeno': score every step on this validation micro-batch (the forward's
        arguments, as train_step takes them); None: back to train_step's default."""
        self.set_zeno_scorer(None if batch is None else zeno_scoring.batch_scorer(batch))

    @property
    def aggregation_stats(self) -> Any:
        """Robust grad_aggregation: the reducer's records of dropped replicas (an AggregationStats of this
        rank's data-parallel group), or None (mean, or no reducer built yet)."""
        red = self._reducer
        return red.robust.stats if red is not None and red.robust is not None else None

    def _tune_step(self) -> None:
        """Bucket autotuning: time this step (first forward to the end of sync_grad) for the tuner."""
        started, self._step_started = self._step_started, None
        tuner = self._autotune
        if tuner is None or not tuner.tuning or started is None:
            return
        if runtime_device().type == "cuda":
            torch.cuda.synchronize()  # while tuning only: the time must include the device's work
        if tuner.record(time.perf_counter() - started, get_host_group(self._dp_ranks())):
            self._retune = True

    def gather_params(self) -> None:
        """ZeRO: all-gather the parameters after the optimizer updated this rank's slice (the
        optimizer from `build_optimizer` calls it)."""
        if self._reducer is not None:
            self._reducer.gather_params()

    def _norm_params(self) -> list[nn.Parameter]:
        """The parameters whose gradients count in the gradient norm: the trainable ones."""
        params = [self._tensor(n) for n, i in self.fullmap.items() if i.is_param]
        return [p for p in params if p.requires_grad]

    def _owned_params(self) -> list[bool]:
        """For each of `_norm_params`: does this rank count it in the gradient norm?"""
        keys = [
            (i.original_name, i.shard)
            for n, i in self.fullmap.items()
            if i.is_param and self._tensor(n).requires_grad
        ]
        if self._norm_owned is None or self._norm_keys != keys:  # parameters frozen since: recount
            self._norm_owned, self._norm_keys = first_holders(keys, self.group("plan")), keys
        return self._norm_owned

    def grad_sq_norm(self) -> torch.Tensor:
        """Squared 2-norm of the gradients of one plan copy (each piece counted once), synced first."""
        if not self._grads_synced:
            self.sync_grad()
        owned = [p for p, own in zip(self._norm_params(), self._owned_params()) if own]
        red = self._reducer
        if red is not None and red.zero:  # each rank holds the reduced gradients of its slice only
            total = red.owned_sq_norm(owned, device=runtime_device())
        else:
            total = grad_sq_norm(owned, device=runtime_device())
        plan = self.group("plan")
        if plan is not None:
            dist.all_reduce(total, group=plan)
        return total

    def clip_gnorm(self, max_norm: float | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """As nnScaler: (total gradient 2-norm, the gradients the optimizer reads). The norm is the same
        on every rank, a 0-dim fp32 device tensor (no host sync: call `float()` on it when the value is
        needed); with `max_norm` (> 0) the gradients are scaled like clip_grad_norm_ (the coefficient
        stays on device). `optimizer.clip_gnorm` (nnscaler.build_optimizer) returns the norm alone."""
        total = self.total_gnorm(max_norm)
        red = self._reducer
        if red is not None and red.zero:
            grads = [piece.grad() for piece in red.pieces]
        else:
            grads = [g for g in (param_grad(p) for p in self.parameters_for_optimizer()) if g is not None]
        return total, grads

    def total_gnorm(self, max_norm: float | None = None) -> torch.Tensor:
        """The total gradient 2-norm as a 0-dim device tensor; clips first when `max_norm` > 0."""
        total = self.grad_sq_norm().sqrt()
        if max_norm is not None and max_norm > 0:
            self.scale_grads(max_norm, total)
        return total

    def scale_grads(self, max_norm: float, total_norm: torch.Tensor) -> None:
        """Scale the (synced) gradients as `clip_grad_norm_` does for `total_norm`; under ZeRO the
        gradients of this rank's slice, which is what its optimizer reads."""
        red = self._reducer
        if red is not None and red.zero:
            red.scale_owned(torch.clamp(max_norm / (total_norm + 1e-6), max=1.0))
        else:
            scale_grads(self.parameters_for_optimizer(), max_norm, total_norm)
