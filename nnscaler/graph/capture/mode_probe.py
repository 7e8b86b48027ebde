"""Do train() and eval() trace to the same program? A cheap run in each mode says, before the second
torch.export.

`mode_reads.reads_training` answers from the code: whether forward can read `training` at all. Many
models read it and still choose alike in both modes (transformers' attention passes
`dropout=0.0 if not self.training else self.attention_dropout`, which is 0.0 either way when the
config's dropout is 0). For those the second trace of `modes.trace_both_modes` repeats the first at
the same cost, about half of capturing both modes (`benchmarks/compile_time.py` times capture). This
probe runs forward on fake tensors (no data, no memory), once in each mode, under a TorchFunctionMode
that logs every torch call: the function, its non-tensor arguments, each tensor argument by where it
came from (a parameter or buffer by name, an input by name, or output i of call n), and the dtype,
shape and requires_grad of what it returned. Equal logs and equal returned values mean the two
traces call the same ops on the same values, so one trace serves both modes.

It errs towards "differ": any failure to run, any argument it cannot name (an object is named by its
repr, an unknown tensor by its identity, which differs between runs unless it is the same object)
sends the caller to the second trace, which decides as before. It runs under the flags torch.export
sets (`torch.compiler.is_exporting()` is True) and the caller's library patches, so code that
branches on them takes the branch it takes in the trace. Written here because torch has no such
comparison.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from nnscaler.graph.capture.library_tracing import static_shape_choices

__all__ = ["modes_trace_alike"]

_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.layout)


class _Parted(Exception):
    """The second run called something the first did not, or got something else back."""


class _CallLog(TorchFunctionMode):
    """Logs torch calls with their arguments named by origin; with `expected`, stops at the first
    call that differs from it."""

    def __init__(self, names: dict[int, tuple], expected: list | None = None) -> None:
        super().__init__()
        self.names = names
        self.calls: list[tuple] = []
        self.expected = expected
        self.alive: list[Any] = []  # every named object lives to the end: ids are never reused

    def name(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) in self.names:
                return self.names[id(value)]
            self.alive.append(value)
            return ("object", id(value))
        if isinstance(value, _PLAIN):
            return (type(value), value)
        if isinstance(value, (list, tuple)):
            return (type(value), tuple(self.name(v) for v in value))
        if isinstance(value, dict):
            return (dict, tuple((k, self.name(v)) for k, v in value.items()))
        if isinstance(value, slice):
            return (slice, self.name(value.start), self.name(value.stop), self.name(value.step))
        self.alive.append(value)
        return (type(value), id(value), repr(value))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        call = (func, self.name(args), self.name(kwargs))
        index = len(self.calls)
        if self.expected is not None and (index >= len(self.expected) or self.expected[index][0] != call):
            raise _Parted
        out = func(*args, **kwargs)
        leaves = pytree.tree_leaves(out)
        # what came out, too: an autocast region entered in one mode only changes no call, only dtypes
        made = tuple(
            (t.dtype, tuple(t.shape), t.requires_grad) for t in leaves if isinstance(t, torch.Tensor)
        )
        if self.expected is not None and self.expected[index][1] != made:
            raise _Parted
        self.calls.append((call, made))
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and id(leaf) not in self.names:
                self.names[id(leaf)] = ("output", index, i)
                self.alive.append(leaf)
        return out


def _exporting_flags():
    """torch.export's own context (is_exporting / is_compiling True), where this torch has it."""
    from torch._export import utils

    return utils._compiling_state_context()


def _run(module: torch.nn.Module, kwargs: dict[str, Any], expected: list | None) -> tuple:
    """One run of forward in the modules' current modes: (calls, returned values, what must stay alive
    while another run is compared with this one)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as fake:
        state = dict(module.named_parameters())
        state.update(module.named_buffers())
        state = {k: fake.from_tensor(v) for k, v in state.items()}
        names: dict[int, tuple] = {id(v): ("state", k) for k, v in state.items()}
        inputs = pytree.tree_map_only(torch.Tensor, fake.from_tensor, kwargs)
        leaves, _ = pytree.tree_flatten_with_path(inputs)
        names.update({id(v): ("input", pytree.keystr(p)) for p, v in leaves if isinstance(v, torch.Tensor)})
        log = _CallLog(names, expected)
        with log:
            out = torch.func.functional_call(module, state, (), inputs)
        returned = log.name(pytree.tree_leaves(out))
    return log.calls, returned, (state, inputs, log.alive)


def modes_trace_alike(module: torch.nn.Module, kwargs: dict[str, Any]) -> bool:
    """True when forward, run in train and in eval mode on fake copies of its inputs and weights, calls
    the same torch functions on the same values and returns the same values. The modules' modes are
    restored; weights and buffers are not touched."""
    modes = {m: m.training for m in module.modules()}  # submodules may differ (a frozen batch norm)
    try:
        with _exporting_flags(), static_shape_choices(kwargs):
            calls, returned, first_run = _run(module, kwargs, None)
            module.train(not module.training)
            again, returned_again, _ = _run(module, kwargs, calls)  # first_run alive: no id reused
        return again == calls and returned_again == returned
    except Exception:  # noqa: BLE001 - anything this probe cannot run is left to the second trace
        return False
    finally:
        for m, training in modes.items():
            m.training = training
