"""The front end: capture (torch.export -> IR), the IR itself, and op annotations.

`IRGraph` (nnScaler 0.8's policy API, nnscaler.graph.policy_api) is loaded on first use.
"""


def __getattr__(name: str):
    if name in ("IRGraph", "IRSegment"):
        from nnscaler.graph import policy_api

        return getattr(policy_api, name)
    raise AttributeError(f"module 'nnscaler.graph' has no attribute {name!r}")
