"""The memory model: parameters, gradients and optimizer state by ZeRO stage and precision,
activations kept for backward (none inside recomputed modules), and transient buffers."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from nnscaler.policies.autodist.comm import all_gather, all_reduce, reduce_scatter
from nnscaler.policies.autodist.cost import CostContext

__all__ = ["MemoryModel"]


@dataclass(frozen=True)
class MemoryModel:
    """Bytes per device as a function of what a plan keeps where."""

    zero_stage: int = 0
    """0: no ZeRO; 1: optimizer state sharded over data-parallel replicas; 2: also gradients; 3: also
    parameters (gathered around their use)."""
    optimizer_bytes_per_param_byte: float = 2.0
    """Optimizer state per byte of weights: Adam keeps two moments (2.0 for fp32 weights)."""
    mixed_precision: bool = False
    """bf16/fp16 weights with fp32 master weights: optimizer state and master copy are fp32 (x2 bytes)."""
    activation_factor: float = 1.0
    """Multiplies saved activations (e.g. micro-batches in flight in a pipeline stage)."""
    transient_mem_coef: float = 2.0
    """Transient buffers (communication, the largest op's workspace) as a multiple of the largest
    activation of a step (nnScaler's `transient_mem_coef`)."""

    def param_state_parts(self, weight_bytes: float, ctx: CostContext) -> dict[str, float]:
        """{'weights', 'gradients', 'optimizer'}: bytes per device of `weight_bytes` of local weights,
        each divided over the data-parallel replicas from the ZeRO stage that shards it."""
        dp = max(ctx.dp_size, 1)
        opt = weight_bytes * self.optimizer_bytes_per_param_byte
        if self.mixed_precision:
            opt = weight_bytes * (2 * self.optimizer_bytes_per_param_byte + 2)  # fp32 moments + master
        grads = weight_bytes
        weights = weight_bytes
        if self.zero_stage >= 1:
            opt /= dp
        if self.zero_stage >= 2:
            grads /= dp
        if self.zero_stage >= 3:
            weights /= dp
        if not ctx.training:
            return {"weights": weights, "gradients": 0.0, "optimizer": 0.0}
        return {"weights": weights, "gradients": grads, "optimizer": opt}

    def grads_outlive_backward(self, ctx: CostContext, nmicros: int, pipelined: bool) -> bool:
        """Whether the gradients stay allocated beside the activations: a data-parallel reducer keeps
        them in its buckets (dp > 1), or micro-batches accumulate them (several micro-batches, pipeline
        stages). Otherwise (one replica, one micro-batch) backward frees each layer's activations as it
        makes the layer's gradients, and the optimizer step zeroes them (set to None) after use."""
        return ctx.dp_size > 1 or nmicros > 1 or pipelined

    def peak_state(
        self,
        parts: dict[str, float],
        activations: float,
        grads_persist: bool,
        backward_peak: float | None = None,
    ) -> float:
        """Peak bytes of weights, gradients, optimizer state and `activations`: their sum where the
        gradients persist; else weights + optimizer + `backward_peak`, the most activations and
        gradients live together while backward frees the one as it makes the other
        (backward_live_peak), or the larger of the two where it is not given."""
        grads = parts.get("gradients", 0.0)
        state = parts.get("weights", 0.0) + parts.get("optimizer", 0.0)
        if grads_persist:
            return state + grads + activations
        return state + (max(grads, activations) if backward_peak is None else backward_peak)

    @staticmethod
    def backward_live_peak(activations: list[float], gradients: list[float]) -> float:
        """The most bytes of saved activations and gradients alive at once in a backward pass over
        ops in forward order: after backward has passed op k, the activations saved by ops before k
        and the gradients of the weights of ops from k on are alive."""
        live = sum(gradients)  # backward done: every gradient, no activation
        peak = live
        for act, grad in zip(activations, gradients):  # walk k forward: op k's backward not yet run
            live += act - grad
            peak = max(peak, live)
        return peak

    def param_state_bytes(self, weight_bytes: float, ctx: CostContext) -> float:
        """Weights + gradients + optimizer state of `weight_bytes` of local weights."""
        return sum(self.param_state_parts(weight_bytes, ctx).values())

    def grad_sync_latency(self, weight_bytes: float, ctx: CostContext, bucket_bytes: float) -> float:
        """The latency part of the gradient sync, which grad_sync_time leaves out: one collective (or
        two, three with ZeRO) per bucket of `bucket_bytes`, each paying its latency steps once."""
        if not ctx.training or ctx.dp_size <= 1 or weight_bytes <= 0:
            return 0.0
        buckets = max(1, math.ceil(weight_bytes / max(bucket_bytes, 1.0)))
        one_byte = 1.0  # the collectives' latency terms, without their bandwidth terms
        if self.zero_stage >= 1:
            per = reduce_scatter(one_byte, ctx.dp_size, ctx.dp_link) + all_gather(
                one_byte, ctx.dp_size, ctx.dp_link
            )
            if self.zero_stage >= 3:
                per += all_gather(one_byte, ctx.dp_size, ctx.dp_link)
        else:
            per = all_reduce(one_byte, ctx.dp_size, ctx.dp_link)
        return buckets * per

    def grad_sync_time(self, weight_bytes: float, ctx: CostContext) -> float:
        """Seconds to synchronise `weight_bytes` of gradients across data-parallel replicas."""
        if not ctx.training or ctx.dp_size <= 1:
            return 0.0
        # gradients travel in large buckets: the bandwidth term counts, per-parameter latency does not
        link = replace(ctx.dp_link, latency_us=0.0)
        if self.zero_stage >= 1:  # reduce-scatter the gradients, all-gather the updated weights
            t = reduce_scatter(weight_bytes, ctx.dp_size, link) + all_gather(weight_bytes, ctx.dp_size, link)
            if self.zero_stage >= 3:  # weights gathered again for backward
                t += all_gather(weight_bytes, ctx.dp_size, link)
            return t
        return all_reduce(weight_bytes, ctx.dp_size, link)
