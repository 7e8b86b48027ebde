"""nnScaler 0.8's `nnscaler.ir` names for its policy API (IRCell, IRFwOperation, IRSubTensor, ...).

A re-export of nnscaler.graph.policy_api (the graph layer), where they live: views of our traced
graph that the IRGraph front records policy decisions on.
"""

from nnscaler.graph.policy_api import (
    IRBpOperation,
    IRCell,
    IRDataOperation,
    IRFullTensor,
    IRFwOperation,
    IRObject,
    IRSubTensor,
    IRTensor,
)

__all__ = [
    "IRCell",
    "IRObject",
    "IRTensor",
    "IRFullTensor",
    "IRSubTensor",
    "IRFwOperation",
    "IRBpOperation",
    "IRDataOperation",
]
