"""Pipeline executor: what the generated `_train_step` / `_infer_step` call to move micro-batches.

The generated schedule code is the order of work; this file does each piece of it: receive a
stage's input activations (blocking, just before use), send its outputs (asynchronous, waited at
the end of the step), backward through a stage given the gradients of its outputs, send the
gradients of its inputs back, and at the end sum the gradients of weights that two stages share
and hand every rank of the pipeline the micro-batches' losses.

No tags (NCCL ignores them): P2P ops between two ranks are matched in issue order, so both must
issue them in one agreed order. The generated code does (nnscaler/policies/p2p_plan.py): it posts
receives early with `post_recv_forward` / `post_recv_backward` where the order needs them, before
later sends. `NNSCALER_STRICT_P2P=1` checks the order on gloo (nnscaler/runtime/p2p.py).

Zero-bubble schedules split a stage's backward: `backward_inputs` / `backward_loss_inputs` (B) compute
the gradients of its inputs and keep its graph, `backward_weights` (W) the gradients of its weights
later (nnscaler/runtime/grads/split_backward.py). In V-shaped schedules two consecutive stages run on
one rank: what one sends the other is handed over in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from nnscaler.runtime.device import is_initialized
from nnscaler.runtime.dist.p2p import P2P, Label, connect
from nnscaler.runtime.grads.split_backward import PendingWeights, backward_inputs, backward_weights
from nnscaler.runtime.module_parts.step_outputs import detached, share_outputs

__all__ = ["TensorSpec", "PipelineStep", "split_micro_batches", "forward_kwargs"]


@dataclass(frozen=True)
class TensorSpec:
    """Shape, dtype and whether gradients flow back, of one activation passed between stages."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def wants_grad(self) -> bool:
        return self.requires_grad and self.dtype.is_floating_point


def split_micro_batches(batch: Any, nmicros: int) -> list[Any]:
    """Split every tensor of a (nested) batch along dim 0 into `nmicros` equal micro-batches."""
    leaves, spec = torch.utils._pytree.tree_flatten(batch)
    sizes = {leaf.shape[0] for leaf in leaves if isinstance(leaf, torch.Tensor) and leaf.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(
            f"cannot split a batch into micro-batches: its tensors have batch sizes {sorted(sizes)}"
        )
    size = sizes.pop()
    if size % nmicros:
        raise ValueError(
            f"a batch of {size} samples cannot be split into pipeline_nmicros={nmicros} equal micro-batches: "
            f"use a batch size that is a multiple of {nmicros}, or pass the micro-batches as a list"
        )
    parts = [
        leaf.chunk(nmicros, dim=0) if isinstance(leaf, torch.Tensor) and leaf.dim() > 0 else [leaf] * nmicros
        for leaf in leaves
    ]
    return [torch.utils._pytree.tree_unflatten([p[m] for p in parts], spec) for m in range(nmicros)]


def forward_kwargs(sample: Any, forward_args: Sequence[str]) -> dict[str, Any]:
    """A micro-batch as forward keyword arguments: a dict of them, one argument's value, or a tuple."""
    if isinstance(sample, Mapping) and set(sample) <= set(forward_args) and sample:
        return dict(sample)
    if len(forward_args) == 1:
        return {forward_args[0]: sample}
    if isinstance(sample, (tuple, list)) and len(sample) == len(forward_args):
        return dict(zip(forward_args, sample))
    raise TypeError(
        f"a micro-batch must be a dict of the forward's arguments {list(forward_args)} (or a tuple of them); "
        f"got {type(sample).__name__}"
        + (f" with keys {sorted(sample)}" if isinstance(sample, Mapping) else "")
    )


def _check_same_shapes(inputs: Sequence[dict[str, Any]]) -> None:
    """Every micro-batch of one step has the shapes of the first (the stages exchange fixed sizes)."""

    def shape(v: Any) -> Any:
        return list(v.shape) if isinstance(v, torch.Tensor) else v

    for m, x in enumerate(inputs[1:], start=1):
        for name, value in x.items():
            if shape(value) != shape(inputs[0][name]):
                what = "shape" if isinstance(value, torch.Tensor) else "size"
                raise ValueError(
                    f"micro-batch {m} has {name} of {what} {shape(value)}, but micro-batch 0 has "
                    f"{shape(inputs[0][name])}: every micro-batch of one train_step / infer_step must have "
                    "the same shapes (different steps may differ); pad them or group samples by length"
                )


class PipelineStep:
    """One train_step / infer_step of a pipelined module on this rank (see the module docstring)."""

    def __init__(
        self,
        model: Any,
        samples: Sequence[Any],
        *,
        train: bool = True,
        scale_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        is_dummy_batch: Sequence[bool] | None = None,
        peers: Sequence[int] = (),
        reduce_stage: int | None = None,
    ) -> None:
        """peers: the ranks this rank's schedule exchanges P2P ops with (connected first, in order).
        reduce_stage: only this stage's last backward launches gradient reductions (a rank running two
        stages that share weights, as in a V, finishes their gradients there); None: every stage's."""
        self.reduce_stage = reduce_stage
        self.model = model
        self.nmicros = len(samples)
        self.kwargs = [forward_kwargs(s, model.forward_args) for s in samples]
        """Each micro-batch as forward keyword arguments."""
        self.train = train
        self.scale_fn = scale_fn
        self.dummy = list(is_dummy_batch) if is_dummy_batch is not None else [False] * self.nmicros
        self.losses: list[torch.Tensor | None] = [None] * self.nmicros
        self.outputs: list[tuple[Any, ...] | None] = [None] * self.nmicros
        """The last stage's whole outputs per micro-batch (for `return_outputs`), detached."""
        self._device = model.device
        self._p2p = P2P(self._device)
        if peers and is_initialized():
            connect(peers, self._device)
        self._posted: dict[tuple[int, bool, int], list[tuple[Any, torch.Tensor]]] = {}
        """(receiving stage key, backward, micro-batch) -> receives posted, not yet waited."""
        self._rank = dist.get_rank() if is_initialized() else None
        self._local: dict[tuple[int, bool, int], list[torch.Tensor]] = {}
        """Sends to this rank itself (consecutive stages on one rank), by the key of `_posted`."""
        self._weights: dict[tuple[int, int], PendingWeights] = {}
        """(stage, micro-batch) -> what its W needs, between its B and its W."""
        self.inputs: list[dict[str, Any]] = []
        """Pipelined modules: each micro-batch's traced inputs and input sizes, by name."""
        self.specs: dict[int, list[TensorSpec]] = {}
        """Pipelined modules: stage -> what it receives (the same for every micro-batch of the step)."""
        if hasattr(model, "micro_batch_inputs"):
            self.inputs = [model.micro_batch_inputs(**kwargs) for kwargs in self.kwargs]
            _check_same_shapes(self.inputs)
            self.specs = model.stage_inputs(self.inputs[0]) if self.inputs else {}

    # ---- point to point (no tags: ops between two ranks are matched in issue order, as on NCCL) ----------
    def _send(
        self, tensors: Sequence[torch.Tensor], dst: int, stage: int, backward: bool, micro: int
    ) -> None:
        if dst == self._rank:  # the next / previous stage runs here too: hand over in memory
            self._local[(stage, backward, micro)] = [t.detach() for t in tensors]
            return
        for i, t in enumerate(tensors):
            if is_initialized():
                self._p2p.send(t.detach().contiguous(), dst, Label("B" if backward else "F", stage, micro, i))

    def _post(self, specs: Sequence[TensorSpec], src: int, stage: int, backward: bool, micro: int) -> None:
        key = (stage, backward, micro)
        if key in self._posted:
            raise RuntimeError(
                f"the receive of {Label('B' if backward else 'F', stage, micro, 0)} was posted twice"
            )
        received = []
        for i, spec in enumerate(specs):
            t = torch.empty(spec.shape, dtype=spec.dtype, device=self._device)
            received.append((self._p2p.recv(t, src, Label("B" if backward else "F", stage, micro, i)), t))
        self._posted[key] = received

    def _recv(self, specs: Sequence[TensorSpec], src: int, stage: int, backward: bool, micro: int) -> list:
        key = (stage, backward, micro)
        if src == self._rank:  # from a stage on this rank, which must have run already
            if key not in self._local:
                raise RuntimeError(
                    f"{Label('B' if backward else 'F', stage, micro, 0)} comes from a stage on this rank that has "
                    "not sent it yet: the schedule runs them in the wrong order"
                )
            return self._local.pop(key)
        if key not in self._posted:
            self._post(specs, src, stage, backward, micro)
        out = []
        for work, t in self._posted.pop(key):
            work.wait()
            out.append(t)
        return out

    def post_recv_forward(self, stage: int, micro: int, src: int) -> None:
        """Post (without waiting) the receive of `stage`'s inputs for `micro`: the P2P order with `src`."""
        self._post(self.specs[stage], src, stage, False, micro)

    def post_recv_backward(self, stage: int, micro: int, src: int) -> None:
        """Post (without waiting) the receive of the gradients of `stage`'s outputs for `micro`."""
        self._post([s for s in self.specs[stage + 1] if s.wants_grad], src, stage + 1, True, micro)

    def recv_forward(self, stage: int, micro: int, src: int) -> list[torch.Tensor]:
        """The input activations of `stage` for `micro`, from the rank running the previous stage."""
        specs = self.specs[stage]
        acts = self._recv(specs, src, stage, False, micro)
        for t, spec in zip(acts, specs):
            if spec.wants_grad and self.train:
                t.requires_grad_(True)
        return acts

    def send_forward(self, outputs: Sequence[torch.Tensor], stage: int, micro: int, dst: int) -> None:
        """Send `stage`'s outputs for `micro` to the rank running the next stage."""
        self._send(outputs, dst, stage + 1, False, micro)

    def recv_backward(self, stage: int, micro: int, src: int) -> list[torch.Tensor | None]:
        """Gradients of `stage`'s outputs (None where no gradient flows), from the next stage's rank."""
        specs = self.specs[stage + 1]
        wanted = [s for s in specs if s.wants_grad]
        grads = iter(self._recv(wanted, src, stage + 1, True, micro))
        return [next(grads) if s.wants_grad else None for s in specs]

    def send_backward(self, inputs: Sequence[torch.Tensor], stage: int, micro: int, dst: int) -> None:
        """Send the gradients of `stage`'s received inputs back to the previous stage's rank."""
        specs = self.specs[stage]
        grads = [
            x.grad if x.grad is not None else torch.zeros_like(x)
            for x, s in zip(inputs, specs)
            if s.wants_grad
        ]
        self._send(grads, dst, stage, True, micro)

    # ---- compute ---------------------------------------------------------------------------------
    def _reducing(self, micro: int | None, stage: int | None = None) -> AbstractContextManager[None]:
        """The last micro-batch's backward launches the gradient reductions as buckets fill, overlapping
        them with the rest of backward (and the pipeline's last sends); earlier ones only accumulate.
        Every schedule runs each stage's backwards in micro-batch order, so that is its last backward."""
        if self.reduce_stage is not None and stage != self.reduce_stage:
            return nullcontext()
        if self.train and micro == self.nmicros - 1 and hasattr(self.model, "reducing"):
            return self.model.reducing()
        return nullcontext()

    def backward(
        self,
        outputs: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        micro: int | None = None,
        stage: int | None = None,
    ) -> None:
        """Backward through one stage from the gradients of its outputs (for micro-batch `micro`)."""
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        if pairs:
            with self._reducing(micro, stage):
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])

    def backward_inputs(
        self,
        outputs: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None],
        inputs: Sequence[torch.Tensor],
        stage: int,
        micro: int,
    ) -> None:
        """B of a split backward: the gradients of `stage`'s `inputs` (their `.grad`, for send_backward);
        the weights' wait for `backward_weights(stage, micro)`."""
        params = self.model.parameters()
        self._weights[(stage, micro)] = backward_inputs(outputs, grads, inputs, params)

    def backward_loss_inputs(
        self, outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], stage: int, micro: int
    ) -> None:
        """B of the last stage: from the loss of `micro` (scaled as in `backward_loss`)."""
        self.backward_inputs([self._scaled_loss(outputs, micro)], [None], inputs, stage, micro)

    def backward_weights(self, stage: int, micro: int) -> None:
        """W of a split backward: accumulate the weights' gradients of `stage` for `micro` into `.grad`."""
        with self._reducing(micro, stage):
            backward_weights(self._weights.pop((stage, micro)))

    def loss(self, outputs: Sequence[torch.Tensor], micro: int) -> torch.Tensor:
        """The last stage's first output is the micro-batch's loss."""
        loss = outputs[0]
        self.losses[micro] = loss.detach()
        if getattr(self.model, "_collect_outputs", False):  # kept only when asked: logits can be large
            self.outputs[micro] = detached(outputs)
        return loss

    def backward_loss(self, outputs: Sequence[torch.Tensor], micro: int, stage: int | None = None) -> None:
        """Backward from the loss of `micro` (scaled by `scale_fn`, zero for a dummy micro-batch)."""
        loss = self._scaled_loss(outputs, micro)
        with self._reducing(micro, stage):
            loss.backward()

    def _scaled_loss(self, outputs: Sequence[torch.Tensor], micro: int) -> torch.Tensor:
        loss = outputs[0]
        if self.scale_fn is not None:
            loss = self.scale_fn(loss)
        return loss * 0.0 if self.dummy[micro] else loss

    # ---- end of step ---------------------------------------------------------------------------------
    def finish(self) -> list[torch.Tensor]:
        """Wait for the sends, sum the gradients of weights shared by stages, return every loss."""
        self._p2p.finish()
        if self._posted or self._local or self._weights:
            raise RuntimeError(
                "pipeline step ended with receives posted but never used or weight gradients never computed: "
                f"{sorted(self._posted) + sorted(self._local) + sorted(self._weights)}"
            )
        if self.train:
            self.model.sync_tied_grads()
        if getattr(self.model, "_collect_outputs", False):  # train_step(return_outputs=True)
            self.model._step_outputs = share_outputs(self.model, self.outputs)
        return self._share_losses()

    def _share_losses(self) -> list[torch.Tensor]:
        model = self.model
        mine = [x for x in self.losses if x is not None]
        values = torch.zeros(self.nmicros, dtype=torch.float32, device=self._device)
        if mine:
            values.copy_(torch.stack([x.float() for x in self.losses]))
        group = model.group("pp")
        if group is not None:
            dist.broadcast(values, model.last_stage_rank, group=group)
        return list(values.unbind(0))
