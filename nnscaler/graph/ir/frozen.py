"""A read-only dict for the IR's mapping fields (a Graph's values, a Node's kwargs, ...)."""

from __future__ import annotations

from typing import Any, NoReturn

__all__ = ["FrozenDict"]


class FrozenDict(dict):
    """A dict whose contents are fixed when it is made: every method that would change it raises.

    A dict subclass rather than types.MappingProxyType: the IR's mappings are read by code that checks
    `isinstance(x, dict)` (ref walking, JSON encoding) and are deep-copied and pickled, none of which
    a mapping proxy supports. To change one, build a new one (`FrozenDict({**old, key: value})`).
    """

    __slots__ = ()

    def _read_only(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(
            "the IR is immutable after capture: this mapping cannot change; build a new graph or node "
            "(dataclasses.replace) with a new mapping instead"
        )

    __setitem__ = __delitem__ = __ior__ = _read_only
    clear = pop = popitem = setdefault = update = _read_only

    def __reduce__(self) -> tuple:
        # copy, deepcopy and pickle rebuild it from a plain dict (the default refills it item by item)
        return (type(self), (dict(self),))
