"""Gradients across ranks: the bucketed reducer (overlap, hierarchy, autotuned bucket size), ZeRO 1/2/3,
mixed-precision optimizers with loss scaling, and the scoped switch that skips gradient sync.

Modules import each other one way: buckets <- reducer <- zero / zero3 (with zero3_blocks below it);
loss_scaler <- mixed_precision; grad_ops and sync_flags are leaves.
"""
