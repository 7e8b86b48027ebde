"""Gradients across ranks: the bucketed reducer (overlap, hierarchy, autotuned bucket size), ZeRO 1/2/3,
mixed-precision optimizers with loss scaling, and the scoped switch that skips gradient sync.

Robust aggregation against faulty replicas (docs/faulty_replicas.md): robust (coordinate-wise rules),
zeno and agg_stats <- aggregation <- reducer; fault_inject (a drill tool) <- reducer.

Modules import each other one way: buckets <- zero_slices <- reducer <- zero / zero3 (with zero3_blocks
below it); loss_scaler <- mixed_precision; grad_ops and sync_flags are leaves.
"""
