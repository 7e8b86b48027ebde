"""End-to-end mode of ParallelModule: `train_step` / `infer_step` run the generated schedule
(`_train_step` / `_infer_step` in the rank's gencode file) over a list of micro-batches."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from nnscaler.runtime.dist import timeline
from nnscaler.runtime.dist.groups import get_group

__all__ = ["EndToEndMixin"]


class EndToEndMixin:
    """Mixed into ParallelModule; the generated subclass sets the class attributes below."""

    use_scheduler: bool = False
    """End-to-end mode with pipeline stages (generated)."""
    nmicros_per_scheduler_step: int = 1
    """Micro-batches a pipelined train_step takes (generated)."""
    forward_args: tuple[str, ...] = ()
    """The traced forward's argument names (generated, end-to-end mode)."""
    last_stage_rank: int = 0
    """The rank whose stage computes the losses this rank's train_step returns (generated)."""

    def add_tied(self, local_name: str, ranks: Sequence[int]) -> None:
        """`local_name` is also held by the pipeline stages on `ranks`: sum its gradient with theirs."""
        if local_name not in self.fullmap:
            raise KeyError(f"add_tied: {local_name!r} is not registered (call add_shard first)")
        self._tied[local_name] = sorted(int(r) for r in ranks)

    def _schedule_fn(self, name: str):
        fn = getattr(sys.modules.get(type(self).__module__), name, None)
        if fn is None:
            raise RuntimeError(
                f"{type(self).__name__} was generated without end-to-end mode: parallelize with "
                "ComputeConfig(use_end2end=True) to use train_step / infer_step, or call the module"
            )
        return fn

    def _micro_batches(self, samples: Any) -> list[Any]:
        from nnscaler.runtime.pipeline import split_micro_batches

        if not isinstance(samples, (list, tuple)):
            return split_micro_batches(samples, self.nmicros_per_scheduler_step)
        if self.use_scheduler and len(samples) != self.nmicros_per_scheduler_step:
            raise ValueError(
                f"{type(self).__name__}.train_step got {len(samples)} micro-batches but the pipeline schedule was "
                f"generated for pas_config['pipeline_nmicros']={self.nmicros_per_scheduler_step}"
            )
        if not samples:
            raise ValueError(f"{type(self).__name__}.train_step got no micro-batches")
        return list(samples)

    def train_step(
        self,
        samples: Any,
        is_dummy_batch: Sequence[bool] | None = None,
        scale_fn: Any = None,
        *,
        return_outputs: bool = False,
    ) -> list[Any]:
        """One optimizer step's forward and backward over `samples` (a list of micro-batches, each the
        forward's arguments as a dict; or one batch, split into the schedule's micro-batches). Gradients
        of the micro-batches add up (a sum, as calling backward on each would), then are averaged over
        the data-parallel replicas. Returns each micro-batch's loss, on every rank; with `return_outputs`
        each micro-batch's whole forward output instead (loss first, detached, in the forward's structure)."""
        if getattr(self, "inference_only", False):
            raise RuntimeError(
                f"{type(self).__name__} was generated with ComputeConfig(inference_only=True): it has no backward "
                "and no gradient reducer, so train_step is not available; use infer_step(samples) or call the "
                "module, or parallelize again with inference_only=False to train"
            )
        samples = self._micro_batches(samples)
        step = self._schedule_fn("_train_step")
        with timeline.span("train_step", micro_batches=len(samples)):
            with self._checked_step("train_step", samples), self.no_sync(), self._outputs(return_outputs):
                losses = step(self, samples, is_dummy_batch=is_dummy_batch, scale_fn=scale_fn)
                outputs = self._step_outputs
            self._zeno_step_batch = samples[-1]  # grad_aggregation='zeno' scores on it by default
            try:
                with timeline.span("sync_grad"):
                    self.sync_grad()
            finally:
                self._zeno_step_batch = None
        return outputs if return_outputs else losses

    def infer_step(self, samples: Any, *, return_outputs: bool = False) -> list[Any]:
        """Forward only over `samples` (as for train_step); returns each micro-batch's loss on every rank
        (with `return_outputs`, its whole forward output)."""
        samples = self._micro_batches(samples)
        step = self._schedule_fn("_infer_step")
        with self._checked_step("infer_step", samples), torch.no_grad(), self._outputs(return_outputs):
            losses = step(self, samples)
            return self._step_outputs if return_outputs else losses

    @contextmanager
    def _outputs(self, collect: bool) -> Iterator[None]:
        """While a step runs: whether PipelineStep.finish leaves the whole outputs in `_step_outputs`."""
        self._collect_outputs, self._step_outputs = collect, None
        try:
            yield
        finally:
            self._collect_outputs = False

    @contextmanager
    def _checked_step(self, what: str, samples: list[Any]) -> Iterator[None]:
        """Run the checks before a step once for all its micro-batches (forward then skips them)."""
        self._preflight(what, lambda: [("samples", samples)])
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False

    def tied_params(self) -> list[torch.nn.Parameter]:
        """The parameters `sync_tied_grads` sums: the reducer reduces them only after that sum."""
        return [p for p in (self._tensor(name) for name in self._tied) if p.requires_grad]

    def sync_tied_grads(self) -> None:
        """Sum the gradients of weights that several pipeline stages hold (tied embedding and head).
        A frozen one (`requires_grad=False`, the same on every stage holding it) has none to sum."""
        for name, ranks in self._tied.items():
            param = self._tensor(name)
            if not param.requires_grad:
                continue
            if param.grad is None:
                param.grad = torch.zeros_like(param)
            group = get_group(ranks)
            if group is not None:
                dist.all_reduce(param.grad, group=group)
