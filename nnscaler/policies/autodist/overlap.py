"""How much of the data-parallel communication a step waits for: each collective against the compute it
can hide behind.

The gradient sync of a step (MemoryModel.grad_sync_time) is made of:

- ZeRO 0: an all-reduce of the gradients, bucket by bucket as backward produces them (DDP's and the
  reducer's bucket overlap): hidden behind the last micro-batch's backward except the last bucket.
- ZeRO 1/2: a reduce-scatter of the gradients (as above), then an all-gather of the updated weights
  after the optimizer step, which nothing overlaps (the next forward needs them).
- ZeRO 3 (FSDP): the weights all-gathered for forward (prefetched one layer ahead, hidden behind the
  forward except the first layer's), again for backward, and the gradients reduce-scattered (both
  hidden behind backward except the last layer's).

Each collective hides behind its window of compute at an efficiency per link (a link's traffic competes
with the compute for memory bandwidth and SMs: NCCL's kernels take some); the part that does not fit is
exposed. The efficiencies are fitted on published runs (OverlapModel's fields).
While it overlaps, the compute slows by `contention` of the hidden communication time (the SMs NCCL
takes). Inter-node and intra-node collectives have their own efficiency (InfiniBand traffic is driven
by proxy threads and copy engines; NVLink traffic by SM kernels).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["OverlapModel", "SyncExposure", "exposed_sync"]


@dataclass(frozen=True)
class OverlapModel:
    """Overlap efficiencies (fraction of a compute window a collective can hide behind)."""

    intra_node: float = 0.0
    """Over NVLink. Fitted with the GEMM table on the calibrate rows of benchmarks/published_runs.yaml
    (gemm_efficiency.FIT_NOTE): 0.0 fitted best (loss 0.063 against 0.073 for any of 0.25-0.9), i.e.
    the published single-node FSDP runs behaved as if their NVLink collectives were not hidden (NCCL's
    SM kernels compete with the compute). Weakly determined: those collectives are a few percent of the
    steps."""
    inter_node: float = 0.95
    """Over the network (proxy threads and copy engines: little competition with compute)."""
    contention: float = 0.1
    """The compute slows by this fraction of the communication time hidden behind it."""
    enabled: bool = True
    """False: nothing overlaps (every collective is exposed, the model before issue 42)."""


@dataclass(frozen=True)
class SyncExposure:
    """The data-parallel sync of one step split into what overlaps and what the step waits for."""

    total: float
    """Seconds of communication (all of it)."""
    exposed: float
    """Seconds the step waits for it (added to the compute)."""
    hidden: float
    """Seconds hidden behind compute (total - exposed - the unhidden tails)."""


def exposed_sync(
    sync: float,
    zero_stage: int,
    forward: float,
    backward: float,
    *,
    buckets: int = 1,
    layers: int = 1,
    inter_node: bool = False,
    model: OverlapModel = OverlapModel(),
) -> SyncExposure:
    """The part of `sync` seconds of gradient sync a step waits for.

    forward / backward: compute seconds of one micro-batch's forward and backward on the device (the
    window the collectives hide behind: the last micro-batch's backward, and under ZeRO 3 its forward).
    buckets: gradient buckets of the all-reduce / reduce-scatter (the last one cannot hide);
    layers: parameter groups ZeRO 3 gathers one by one (the first forward gather cannot hide).
    """
    if sync <= 0:
        return SyncExposure(0.0, 0.0, 0.0)
    if not model.enabled:
        return SyncExposure(sync, sync, 0.0)
    eff = model.inter_node if inter_node else model.intra_node
    if zero_stage >= 3:  # all-gather (forward), all-gather (backward), reduce-scatter: a third each
        fwd_comm, bwd_comm, after = sync / 3, 2 * sync / 3, 0.0
        fwd_tail = fwd_comm / max(layers, 1)
        bwd_tail = (sync / 3) / max(layers, 1)
    elif zero_stage >= 1:  # reduce-scatter (backward), all-gather after the optimizer step
        fwd_comm, bwd_comm, after = 0.0, sync / 2, sync / 2
        fwd_tail, bwd_tail = 0.0, bwd_comm / max(buckets, 1)
    else:
        fwd_comm, bwd_comm, after = 0.0, sync, 0.0
        fwd_tail, bwd_tail = 0.0, bwd_comm / max(buckets, 1)
    exposed = after
    hidden = 0.0
    for comm, tail, window in ((fwd_comm, fwd_tail, forward), (bwd_comm, bwd_tail, backward)):
        if comm <= 0:
            continue
        can_hide = max(comm - tail, 0.0)
        hid = min(can_hide, eff * max(window, 0.0))
        hidden += hid
        exposed += comm - hid
    exposed += model.contention * hidden
    return SyncExposure(sync, exposed, hidden)
