"""A time budget for tracing with sizes left open (ComputeConfig.trace_time_budget_s).

With every input dim symbolic, torch.export simplifies the shape guards it meets with sympy, and some
models (shifted windows: `torch.roll`, padding to a multiple of the window, views by `H // window`)
make that take minutes where tracing with fixed sizes takes a second. `run_within` runs the symbolic
capture under a watchdog thread: past the budget it raises a private BaseException in the tracing
thread (`PyThreadState_SetAsyncExc`, which interrupts pure-Python work such as sympy's from any
thread; `except Exception` handlers inside torch do not catch it), and turns it into
`TraceBudgetExceeded`, naming the user's source line the trace was at. The caller then traces with
fixed sizes. The watchdog is cancelled under a lock once the work returns, and an interrupt it set but
Python had not yet raised is cleared, so none can surface after `run_within` returns.

An interrupt can land at any bytecode, so the watchdog waits while the thread imports a module (a
module cut short stays half-initialised in sys.modules) or leaves a context manager (`__exit__`), and
the thread-local torch state a cut trace may leave changed (mode stacks, grad mode, dispatch key
sets, dynamo's frame callback, the tracing context) is put back before the fixed-size trace.
"""

from __future__ import annotations

import ctypes
import logging
import math
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from nnscaler.errors import TraceError
from nnscaler.graph.capture.user_frames import user_frame

__all__ = [
    "TraceBudget",
    "TraceBudgetExceeded",
    "TraceBudgetWarning",
    "capture_within_budget",
    "run_within",
    "user_line",
]

T = TypeVar("T")
_log = logging.getLogger(__name__)


class _BudgetInterrupt(BaseException):
    """Raised asynchronously in the tracing thread by the watchdog (never seen outside this module)."""


class TraceBudgetExceeded(TraceError):
    """Tracing with sizes left open ran past `ComputeConfig.trace_time_budget_s`; `where` is the user's
    source line it was at (or what torch.export was doing after forward had run)."""

    def __init__(self, seconds: float, where: str):
        super().__init__(
            f"tracing with input sizes left open took more than {seconds:g} s (at {where}); raise "
            "ComputeConfig.trace_time_budget_s (None: no limit) to let it finish"
        )
        self.seconds = seconds
        self.where = where


class TraceBudget:
    """A deadline shared by every trace of one capture (both modes, leaf retries, constant folding's
    retry). `seconds` None or 0: no limit."""

    def __init__(self, seconds: float | None):
        if seconds is not None and not seconds >= 0:
            raise ValueError(
                f"trace_time_budget_s must be >= 0 seconds (None or 0: no limit), got {seconds!r}"
            )
        self.seconds = float(seconds) if seconds and math.isfinite(seconds) else None
        self.start = time.monotonic()

    def remaining(self) -> float | None:
        """Seconds left (<= 0 when spent), None without a limit."""
        if self.seconds is None:
            return None
        return self.seconds - (time.monotonic() - self.start)


def user_line(frames: list[traceback.FrameSummary]) -> str | None:
    """The innermost frame outside torch, nnscaler, sympy and the standard library, as
    `file:line in function: code`; None when every frame is library code."""
    frame = user_frame(frames)
    if frame is None:
        return None
    return f'File "{frame.filename}", line {frame.lineno}, in {frame.name}: {(frame.line or "").strip()}'


class _Watchdog:
    """Raises _BudgetInterrupt in thread `tid` after `seconds`, unless cancelled first."""

    def __init__(self, tid: int, seconds: float):
        self.tid, self.lock = tid, threading.Lock()
        # a class of its own: a run_within inside another's work handles only its own interrupt
        self.interrupt: type[_BudgetInterrupt] = type("_BudgetInterrupt", (_BudgetInterrupt,), {})
        self.cancelled = self.fired = False
        self.frames: list[traceback.FrameSummary] = []
        self.timer = threading.Timer(max(seconds, 0.0), self._fire)
        self.timer.daemon = True
        self.wait_until = time.monotonic() + max(seconds, 0.0) + _MAX_WAIT_S  # see _unsafe_to_interrupt

    def _fire(self) -> None:
        with self.lock:
            if self.cancelled:
                return
            frame = sys._current_frames().get(self.tid)
            waits = time.monotonic() < self.wait_until
            if waits and frame is not None and _unsafe_to_interrupt(frame):  # until it is out of there
                self.timer = threading.Timer(_RETRY_S, self._fire)
                self.timer.daemon = True
                self.timer.start()
                return
            stack = traceback.extract_stack(frame) if frame is not None else []
            # only what runs inside run_within's work: not the caller's frames around it
            starts = [i for i, f in enumerate(stack) if f.name == "run_within" and f.filename == __file__]
            self.frames = stack[starts[-1] + 1 :] if starts else stack
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self.tid), ctypes.py_object(self.interrupt)
            )
            self.fired = True

    def cancel(self) -> bool:
        """Stop the watchdog; whether it had fired (an interrupt may then still be pending)."""
        with self.lock:
            self.cancelled = True
            self.timer.cancel()
            return self.fired


_RETRY_S = 0.02
_MAX_WAIT_S = 10.0
"""The longest the watchdog waits past the budget for an import or a context exit to end."""


def _unsafe_to_interrupt(frame: Any) -> bool:
    """Whether the thread is importing a module (cut short, it would stay half-initialised in
    sys.modules, and importing it again fails) or leaving a context manager (cut short, the state it
    restores would stay changed)."""
    while frame is not None:
        code = frame.f_code
        if code.co_name == "run_within" and code.co_filename == __file__:
            return False  # only the work's own frames count
        if code.co_filename.startswith("<frozen importlib") or code.co_name in ("__exit__", "__aexit__"):
            return True
        frame = frame.f_back
    return False


class _TorchState:
    """This thread's torch state that a trace cut short at any bytecode (even inside a `finally`) may
    leave changed: grad mode, the Python dispatch and function mode stacks, the dispatcher's local key
    sets, dynamo's frame callback and the tracing context. `restore` puts back what differs."""

    def __init__(self) -> None:
        from torch._C._dynamo import eval_frame

        self.grad = torch.is_grad_enabled()
        self.dispatch = torch._C._len_torch_dispatch_stack()
        self.infra = {
            k: torch._C._get_dispatch_mode(k) for k in torch._C._TorchDispatchModeKey.__members__.values()
        }
        self.function = torch._C._len_torch_function_stack()
        self.include = torch._C._dispatch_tls_local_include_set().raw_repr()
        self.exclude = torch._C._dispatch_tls_local_exclude_set().raw_repr()
        self.callback = eval_frame.get_eval_frame_callback()
        self.context = torch._guards.TracingContext.try_get()

    @classmethod
    def capture(cls) -> _TorchState | None:
        """The state now; None where this torch lacks one of the private hooks it reads."""
        try:
            return cls()
        except (AttributeError, TypeError, ImportError) as exc:  # another torch release
            _log.debug("torch state is not saved around the budgeted trace: %s", exc)
            return None

    def restore(self) -> list[str]:
        """Put the state back; what had to be restored, for the log."""
        from torch._C._dynamo import eval_frame

        fixed = []
        for key, mode in self.infra.items():  # fake / proxy / functional modes live in slots of their own
            if torch._C._get_dispatch_mode(key) is not mode:
                if mode is None:
                    torch._C._unset_dispatch_mode(key)
                else:
                    torch._C._set_dispatch_mode(mode)
                fixed.append(f"{key.name.lower()} mode")
        while torch._C._len_torch_dispatch_stack() > self.dispatch:
            fixed.append(f"dispatch mode {type(torch._C._pop_torch_dispatch_stack(None)).__name__}")
        while torch._C._len_torch_function_stack() > self.function:
            fixed.append(f"function mode {type(torch._C._pop_torch_function_stack()).__name__}")
        if torch.is_grad_enabled() != self.grad:
            torch.set_grad_enabled(self.grad)
            fixed.append("grad mode")
        for saved, current, setter, what in (
            (
                self.include,
                torch._C._dispatch_tls_local_include_set,
                torch._C._dispatch_tls_set_dispatch_key_included,
                "included",
            ),
            (
                self.exclude,
                torch._C._dispatch_tls_local_exclude_set,
                torch._C._dispatch_tls_set_dispatch_key_excluded,
                "excluded",
            ),
        ):
            if current().raw_repr() == saved:
                continue
            keys = torch.DispatchKeySet.from_raw_repr(saved)
            for key in torch._C.DispatchKey.__members__.values():
                try:
                    if keys.has(key) != current().has(key):
                        setter(key, keys.has(key))
                        fixed.append(f"dispatch key {key.name} {what}")
                except Exception:  # noqa: BLE001 - alias keys cannot be asked or set one by one
                    continue
        if eval_frame.get_eval_frame_callback() is not self.callback:
            eval_frame.set_eval_frame(self.callback)
            fixed.append("dynamo frame callback")
        if torch._guards.TracingContext.try_get() is not self.context:
            torch._guards._TLS.tracing_context = self.context
            fixed.append("tracing context")
        return fixed


def _clear_pending(tid: int) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)


def run_within(budget: TraceBudget | None, work: Callable[[], T]) -> T:
    """`work()`, interrupted with TraceBudgetExceeded when the budget runs out first."""
    left = budget.remaining() if budget is not None else None
    if left is None:
        return work()
    assert budget is not None and budget.seconds is not None
    if left <= 0:
        raise TraceBudgetExceeded(budget.seconds, "the start of a trace: the budget was spent before it")
    tid = threading.get_ident()
    watchdog, state = _Watchdog(tid, left), _TorchState.capture()
    try:
        try:
            watchdog.timer.start()
            return work()
        finally:
            if watchdog.cancel():  # fired: its interrupt may not have been raised yet
                _clear_pending(tid)
    except watchdog.interrupt as interrupt:
        try:
            fixed = state.restore() if state is not None else []
        except Exception as exc:  # noqa: BLE001 - the fixed-size trace may still work
            fixed = [f"not restored: {exc}"]
        if fixed:
            _log.debug("the trace cut short by its budget left torch state changed; restored: %s", fixed)
        frames = watchdog.frames or traceback.extract_tb(interrupt.__traceback__)
        where = (
            user_line(frames)
            or "the end of the trace, after forward had run (torch.export was solving size guards)"
        )
        raise TraceBudgetExceeded(budget.seconds, where) from None


class TraceBudgetWarning(UserWarning):
    """Tracing with sizes left open ran out of time: the module was traced with every size fixed."""


def capture_within_budget(
    seconds: float | None,
    open_trace: Callable[[], T],
    fixed_trace: Callable[[], T],
    module: Any,
    dummy_forward_args: dict[str, Any],
) -> T:
    """`open_trace()` (sizes left open) within `seconds`; past them, a TraceBudgetWarning naming the line
    and every input dim that is now fixed, and `fixed_trace()` (not bounded: nothing is left to fall back
    to; with fixed sizes it is the fast trace)."""
    from nnscaler.graph.capture.export import _clear_dim_marks

    budget = TraceBudget(seconds)
    try:
        out = run_within(budget, open_trace)
        left = budget.remaining()
        if budget.seconds is not None and left is not None and left < budget.seconds / 2:
            _log.info(
                "tracing %s with input sizes left open took %.1f s of its %g s budget "
                "(ComputeConfig.trace_time_budget_s; past it, sizes are fixed)",
                type(module).__name__,
                budget.seconds - left,
                budget.seconds,
            )
        return out
    except TraceBudgetExceeded as over:
        _clear_dim_marks(dummy_forward_args)  # a trace cut short leaves its marks; the retry fixes every dim
        fixed = _fixed_dims(dummy_forward_args)
        warnings.warn(
            f"{type(module).__name__}: tracing with input sizes left open took more than {over.seconds:g} s "
            f"(ComputeConfig.trace_time_budget_s); it was at {over.where}. Traced again with every input size "
            f"fixed to the dummy inputs' ({fixed}): the compiled module accepts only those shapes. Raise "
            "ComputeConfig.trace_time_budget_s (None: no limit) to keep sizes open",
            TraceBudgetWarning,
            stacklevel=3,
        )
        return fixed_trace()


def _fixed_dims(kwargs: dict[str, Any]) -> str:
    """`x (2, 7, 9, 4), mask (2, 7)`: the shapes of the tensor inputs."""
    from torch.utils import _pytree as pytree

    parts = []
    for name, value in kwargs.items():
        for path, leaf in pytree.tree_flatten_with_path(value)[0]:
            if hasattr(leaf, "shape") and len(leaf.shape):
                parts.append(f"{name}{pytree.keystr(path)} {tuple(leaf.shape)}")
    return ", ".join(parts) or "no tensor inputs"
