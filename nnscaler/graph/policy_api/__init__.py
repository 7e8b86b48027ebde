"""nnScaler 0.8's policy API (IRGraph primitives and IR names) as a front that records into a Plan.

A 0.8-style policy `policy(graph: IRGraph, cfg) -> IRGraph` runs as a `pas_policy`: it is given an
IRGraph over our traced Graph, its calls are checked and recorded (record.py), and
nnscaler.policies.policy_api08 converts the record into the same Plan a policy written as
`(graph, cfg) -> Plan` would return for the same choices (docs/policies.md).
"""

from __future__ import annotations

from nnscaler.graph.policy_api.cells import (
    DimAlgorithm,
    IRBpOperation,
    IRCell,
    IRDataOperation,
    IRDimops,
    IRFullTensor,
    IRFwOperation,
    IRGraphAnchor,
    IRObject,
    IRSubTensor,
    IRTensor,
)
from nnscaler.graph.policy_api.irgraph import IRGraph, IRSegment
from nnscaler.graph.policy_api.record import NodeFate, PolicyRecord, ScheduleRecord
from nnscaler.graph.policy_api.schedule import PredefinedSched, SchedulePlan

__all__ = [
    "IRGraph",
    "IRSegment",
    "IRCell",
    "IRObject",
    "IRTensor",
    "IRFullTensor",
    "IRSubTensor",
    "IRFwOperation",
    "IRBpOperation",
    "IRDataOperation",
    "IRDimops",
    "IRGraphAnchor",
    "DimAlgorithm",
    "PredefinedSched",
    "SchedulePlan",
    "NodeFate",
    "PolicyRecord",
    "ScheduleRecord",
]
