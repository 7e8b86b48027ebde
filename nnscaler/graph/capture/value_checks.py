"""Value checks that only raise: traced as assumptions, checked again when the generated code runs.

torch.export cannot trace `if labels.max() >= self.vocab_size: raise ValueError(...)`: the `if`
reads a tensor's value. While capturing, `trace_value_checks()` answers such reads itself when the
statement reading the value is a check that only raises:

    if <cond>: raise ...            (every statement of the `if` body is a `raise`)
    assert <cond>[, message]
    torch._assert(<cond>, message)

It records the op `nnscaler_check::value_check(cond, raise_when, exc, message, where)` on the traced
condition (the generated code calls `nnscaler.runtime.checks.raise_if` / `raise_unless`, which raise
the model's exception type and message on the rank that sees the bad value) and answers with the
value that does not raise, so tracing goes on. After capture, a check on a computed tensor is made
element-wise (graph/capture/local_checks.py), so no plan gathers a tensor only to check it. `x.max().item() >= n` in such a condition traces as
the tensor comparison (`.item()` answers the 0-d tensor itself there).

Conditions joined by `or` in an `if` (`and` in an `assert`), and negated with `not`, are checked one
by one. Other shapes of condition (`if a and b: raise`, a chained comparison `0 <= x.min() < n`) and
every other read of a tensor's value keep torch's behaviour: export fails on them and capture falls
back to opaque leaf modules (graph/capture/leaf_modules.py).

The exception and its message are evaluated in the model's frame when that needs no tensor values
(`ValueError(f"labels must be < {self.vocab_size}")`); otherwise the message is the source text of
the `raise` statement.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import dis
import functools
import linecache
import os
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx.node
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.overrides import TorchFunctionMode

from nnscaler.graph.ops.check import VALUE_CHECK_OP

__all__ = ["VALUE_CHECK_OP", "trace_value_checks"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_NNSCALER_DIR = os.path.dirname(os.path.dirname(os.path.dirname(__file__))) + os.sep
_BOOL = {torch.Tensor.__bool__, torch._C.TensorBase.__bool__}
_ITEM = {torch.Tensor.item, torch._C.TensorBase.item}
_NESTED_TESTS = (ast.BoolOp, ast.UnaryOp, ast.IfExp, ast.Lambda, ast.comprehension, ast.NamedExpr)
_LIB: torch.library.Library | None = None


@dataclass(frozen=True)
class _Site:
    """A check statement: where it is, which value each tensor read in its test must have."""

    stmt: ast.stmt
    want: bool
    """The value every tensor truth-tested in the condition has when the check passes."""
    where: str
    """'file.py:line'."""
    text: str
    """The statement's source (first line)."""


def _library() -> None:
    """Define `nnscaler_check::value_check` once (its eager kernel checks, as generated code does)."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("nnscaler_check", "FRAGMENT")
    lib.define("value_check(Tensor cond, bool raise_when, str exc, str message, str where) -> Tensor")

    def kernel(cond: torch.Tensor, raise_when: bool, exc: str, message: str, where: str) -> torch.Tensor:
        if bool(cond.any() if raise_when else not cond.all()):
            cls = getattr(builtins, exc, None)
            cls = cls if isinstance(cls, type) and issubclass(cls, BaseException) else RuntimeError
            raise cls(message)
        return cond.clone()

    lib.impl("value_check", kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(
        "nnscaler_check::value_check", lambda cond, *_: torch.empty_like(cond), lib=lib
    )
    torch.fx.node.has_side_effect(torch.ops.nnscaler_check.value_check.default)  # export keeps it
    _LIB = lib


@functools.lru_cache(maxsize=64)
def _parsed(filename: str, source: str) -> ast.Module | None:
    try:
        return ast.parse(source, filename)
    except SyntaxError:
        return None


def _check_stmt(filename: str, lineno: int) -> tuple[ast.stmt, str] | None:
    """The innermost `if` whose body only raises, or `assert`, whose condition spans `lineno`."""
    lines = linecache.getlines(filename)
    if not lines:
        return None
    source = "".join(lines)
    tree = _parsed(filename, source)
    if tree is None:
        return None
    best = None
    for node in ast.walk(tree):
        if not isinstance(node, (ast.If, ast.Assert)):
            continue
        test = node.test
        if not test.lineno <= lineno <= (test.end_lineno or test.lineno):
            continue
        if isinstance(node, ast.If) and not all(
            isinstance(s, ast.Raise) and s.exc is not None for s in node.body
        ):
            continue
        if best is None or node.lineno >= best.lineno:
            best = node
    return (best, source) if best is not None else None


def _wanted(test: ast.expr, want: bool) -> bool | None:
    """The value each truth-tested tensor of `test` has when `bool(test) == want`; None when that
    depends on which operand is read (`a and b` wanted false) or operands test truth inside."""
    wants: set[bool] = set()

    def walk(e: ast.expr, w: bool) -> bool:
        if isinstance(e, ast.UnaryOp) and isinstance(e.op, ast.Not):
            return walk(e.operand, not w)
        if isinstance(e, ast.BoolOp):
            if isinstance(e.op, ast.Or) == w:  # `a or b` true / `a and b` false: either operand may do it
                return False
            return all(walk(v, w) for v in e.values)
        if any(isinstance(n, _NESTED_TESTS) for n in ast.walk(e)):
            return False
        if any(isinstance(n, ast.Compare) and len(n.ops) > 1 for n in ast.walk(e)):
            return False  # `0 <= x < n` truth-tests `0 <= x` itself
        wants.add(w)
        return True

    return wants.pop() if walk(test, want) and len(wants) == 1 else None


def _user_frame(skip_torch: bool = False) -> types.FrameType | None:
    """The frame that asked for the tensor's value: the first one outside torch's dispatch (the modes'
    `__torch_function__`) and this module (`skip_torch`: outside torch, for torch._assert's caller);
    None when that is torch's or nnscaler's own code."""
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_name == "__torch_function__"
        or frame.f_code.co_filename == __file__
        or (skip_torch and frame.f_code.co_filename.startswith(_TORCH_DIR))
    ):
        frame = frame.f_back
    if frame is None or frame.f_code.co_filename.startswith((_TORCH_DIR, _NNSCALER_DIR)):
        return None
    return frame


def _tests_truth(frame: types.FrameType) -> bool:
    """Whether the frame's current instruction is the statement's own truth test (a conditional jump,
    `not`), not a call inside the condition that tests truth itself (`all([a, b])`)."""
    code = frame.f_code.co_code
    if not 0 <= frame.f_lasti < len(code):
        return False
    op = dis.opname[code[frame.f_lasti]]
    return ("JUMP" in op and "IF" in op) or op in ("UNARY_NOT", "TO_BOOL")


def _site(frame: types.FrameType) -> _Site | None:
    found = _check_stmt(frame.f_code.co_filename, frame.f_lineno)
    if found is None:
        return None
    stmt, source = found
    want = _wanted(stmt.test, isinstance(stmt, ast.Assert))
    if want is None:
        return None
    text = (ast.get_source_segment(source, stmt) or "").splitlines()[0]
    where = f"{os.path.basename(frame.f_code.co_filename)}:{stmt.lineno}"
    return _Site(stmt, want, where, text)


class _NoTensorValues(TorchFunctionMode):
    """Refuses every tensor operation: evaluating a message must not read (or trace) tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        raise LookupError("the message reads tensors")


def _eval(expr: ast.expr, frame: types.FrameType, source: str) -> Any:
    code = compile(ast.Expression(body=expr), frame.f_code.co_filename, "eval")
    with _NoTensorValues():
        return eval(code, frame.f_globals, dict(frame.f_locals))  # noqa: S307 - the model's own expression


def _class_name(cls: type) -> str:
    """How generated code names the exception class: 'ValueError' or 'package.module:Qualname'."""
    if cls.__module__ == "builtins":
        return cls.__qualname__
    return f"{cls.__module__}:{cls.__qualname__}"


def _exception(stmt: ast.stmt, frame: types.FrameType, source: str) -> tuple[str, str]:
    """(exception class name, message) of the check, evaluated in the model's frame where that reads
    no tensor; else the class (if it evaluates) and the `raise` statement's source text."""
    if isinstance(stmt, ast.Assert):
        if stmt.msg is None:
            return "AssertionError", ""
        try:
            return "AssertionError", str(_eval(stmt.msg, frame, source))
        except Exception:  # noqa: BLE001 - the message needs tensor values: its source stands in
            return "AssertionError", ast.unparse(stmt.msg)
    raise_stmt = stmt.body[0]
    exc = raise_stmt.exc
    try:
        value = _eval(exc, frame, source)
    except Exception:  # noqa: BLE001 - see below
        value = None
    if isinstance(value, BaseException):
        return _class_name(type(value)), str(value)
    if isinstance(value, type) and issubclass(value, BaseException):
        return _class_name(value), ""
    cls = RuntimeError
    if isinstance(exc, ast.Call):
        try:
            found = _eval(exc.func, frame, source)
            cls = found if isinstance(found, type) and issubclass(found, BaseException) else cls
        except Exception:  # noqa: BLE001 - the class cannot be named: RuntimeError with the source text
            pass
    return _class_name(cls), ast.unparse(raise_stmt)  # one line, however the source wraps it


def _record(cond: torch.Tensor, raise_when: bool, exc: str, message: str, where: str) -> None:
    _library()
    torch.ops.nnscaler_check.value_check(cond, raise_when, exc, message, where)


def _traced(t: Any) -> bool:
    """A traced (fake) tensor of one element; asking adds no guard on symbolic sizes."""
    if not isinstance(t, torch.Tensor) or not torch._subclasses.fake_tensor.is_fake(t):
        return False
    return statically_known_true(t.numel() == 1)


class _ValueCheckMode(TorchFunctionMode):
    """Answers truth tests of traced tensors inside value checks that only raise (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch._assert and args and _traced(args[0]):
            frame = _user_frame(skip_torch=True)
            if frame is not None:
                message = args[1] if len(args) > 1 else kwargs.get("message", "")
                text = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
                where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}  {text}"
                _record(args[0], False, "AssertionError", str(message), where)
                return None
        elif func in _BOOL and args and _traced(args[0]):
            answer = self._truth(args[0])
            if answer is not None:
                return answer
        elif func in _ITEM and args and _traced(args[0]):
            frame = _user_frame()
            if frame is not None and _site(frame) is not None:
                return args[0].reshape(())  # `x.max().item() >= n` compares as a tensor
        return func(*args, **kwargs)

    @staticmethod
    def _truth(cond: torch.Tensor) -> bool | None:
        frame = _user_frame()
        site = _site(frame) if frame is not None and _tests_truth(frame) else None
        if site is None:
            return None
        source = "".join(linecache.getlines(frame.f_code.co_filename))
        exc, message = _exception(site.stmt, frame, source)
        _record(cond, not site.want, exc, message, f"{site.where}  {site.text}")
        return site.want


@contextlib.contextmanager
def trace_value_checks() -> Iterator[None]:
    """Around a capture: value checks that only raise trace as assumptions and run-time checks."""
    _library()
    with _ValueCheckMode():
        yield
