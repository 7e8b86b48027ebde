"""One real run of the model on the dummy inputs: what capture's opaque leaves need to know from it.

Each submodule's calls (`CallRecord`: the output's structure and sizes, or why it cannot run as an
opaque op), each leaf method's calls and the parameters and buffers of its module it uses (a torch
function mode sees every tensor an op is given). The run takes no gradients and restores the RNG state
and buffers. Nothing runs on the meta device: there the records are None.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

from nnscaler.graph.capture.leaf_op import (
    CallRecord,
    LeafSession,
    TensorSlot,
    describe_io,
    restore_attributes,
    split_key,
    state_of,
)
from nnscaler.graph.capture.leaf_regions import owner_of

__all__ = ["is_meta", "real_run", "record_calls", "ensure_records", "suitable", "record_methods"]


def is_meta(root: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    tensors = [*root.parameters(), *root.buffers(), *pytree.tree_leaves(kwargs)]
    return any(isinstance(t, torch.Tensor) and t.is_meta for t in tensors)


def real_run(root: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """One real forward on the dummy inputs: no grad, RNG and buffers restored (it raises what forward raises)."""
    tensors = [*root.parameters(), *root.buffers(), *pytree.tree_leaves(kwargs)]
    saved = {n: b.detach().clone() for n, b in root.named_buffers()}
    cuda = sorted({t.device.index or 0 for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda})
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=cuda):
            root(**kwargs)
    finally:
        with torch.no_grad():
            for n, b in root.named_buffers():
                if n in saved:
                    b.copy_(saved[n])


def record_calls(
    root: torch.nn.Module, kwargs: dict[str, Any], methods: Sequence[str] = ()
) -> tuple[dict[str, list[CallRecord]] | None, dict[str, list[str]]]:
    """Every submodule call of one real forward on the dummy inputs, and every call of the leaf `methods`
    with the state each method used. None when the weights or inputs are on the meta device, or forward
    fails eagerly."""
    if is_meta(root, kwargs):
        return None, {}
    records: dict[str, list[CallRecord]] = {}
    used: dict[str, list[str]] = {}

    def hook(path: str):
        def record(module, args, kw, output) -> None:
            leaves, spec = pytree.tree_flatten(output)
            slots = tuple(
                TensorSlot(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in leaves
            )
            why = describe_io((args, kw), "its arguments") or describe_io(output, "its output")
            records.setdefault(path, []).append(CallRecord(spec, slots, why))

        return record

    handles = [m.register_forward_hook(hook(p), with_kwargs=True) for p, m in root.named_modules() if p]
    try:
        with record_methods(root, list(methods), records, used):
            real_run(root, kwargs)
    except Exception:  # noqa: BLE001 - no records: output sizes must then follow from input sizes
        return None, {}
    finally:
        for h in handles:
            h.remove()
    return records, used


def ensure_records(
    root: torch.nn.Module, kwargs: dict[str, Any], session: LeafSession, keys: Sequence[str]
) -> None:
    """Real calls recorded for every module and for the leaf methods among `keys`: one real run serves
    every module leaf found later; a method not yet watched takes one more."""
    methods = [k for k in keys if split_key(k)[1] is not None]
    if session.records is None and session.recorded:
        return  # no real run is possible
    missing = [k for k in methods if k not in session.used]
    if session.recorded and not missing:
        return
    records, used = record_calls(root, kwargs, missing)
    session.recorded = True
    if records is None:
        session.records = None
        return
    merged = dict(session.records or {})
    merged.update({k: v for k, v in records.items() if k in missing or k not in merged})
    session.records = merged
    session.used.update(used)


def suitable(path: str, records: dict[str, list[CallRecord]] | None) -> bool:
    calls = (records or {}).get(path)
    return records is None or (bool(calls) and not any(c.unsuitable for c in calls))


class _Uses(TorchFunctionMode):
    """Records which of the given tensors an op was given."""

    def __init__(self, names: dict[int, str], seen: set[str]):
        super().__init__()
        self.names, self.seen = names, seen

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        for leaf in pytree.tree_leaves((args, kwargs)):
            name = self.names.get(id(leaf))
            if name is not None:
                self.seen.add(name)
        return func(*args, **kwargs)


@contextlib.contextmanager
def record_methods(
    root: torch.nn.Module, keys: list[str], records: dict[str, list[CallRecord]], used: dict[str, list[str]]
) -> Iterator[None]:
    """Inside (one real run of `root`), each leaf method of `keys` records its calls into `records` and
    the names of its module's tensors it uses into `used`."""
    patched = []
    try:
        for key in keys:
            owner, name = owner_of(root, key), split_key(key)[1]
            had, original = name in owner.__dict__, getattr(owner, name)
            names = {id(t): n for n, t in state_of(owner)}
            seen: set[str] = set()
            used[key] = []

            def watched(*args, _key=key, _original=original, _names=names, _seen=seen, **kwargs):
                with _Uses(_names, _seen):
                    out = _original(*args, **kwargs)
                leaves, spec = pytree.tree_flatten(out)
                slots = tuple(
                    TensorSlot(tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else t for t in leaves
                )
                why = describe_io((args, kwargs), "its arguments") or describe_io(out, "its output")
                records.setdefault(_key, []).append(CallRecord(spec, slots, why))
                used[_key] = [n for n, _ in state_of(owner_of(root, _key)) if n in _seen]
                return out

            setattr(owner, name, watched)
            patched.append((owner, name, had, original))
        yield
    finally:
        restore_attributes(patched)
