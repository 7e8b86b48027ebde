"""Mixture of experts at run time: the experts as one op (`torch.ops.nnscaler.moe_experts`, exact on
one device) and expert parallelism over an `ep` group (all-to-all dispatch and return, grouped GEMM).
Generated code imports this package as `moe` and calls `moe.expert_parallel_experts`."""

from __future__ import annotations

from nnscaler.runtime.moe.dispatch import all_to_all_v, expert_parallel_experts, routing_log
from nnscaler.runtime.moe.experts import ACTIVATIONS, capacity, local_experts
from nnscaler.runtime.moe.op import MOE_OP, moe_experts

__all__ = [
    "ACTIVATIONS",
    "MOE_OP",
    "all_to_all_v",
    "capacity",
    "expert_parallel_experts",
    "local_experts",
    "moe_experts",
    "routing_log",
]
