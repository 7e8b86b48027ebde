"""Run torch.export (training IR, strict=False) on a module with dummy keyword inputs."""

from __future__ import annotations

import inspect
import re
import traceback
import warnings
from typing import Any

import torch

from nnscaler.errors import TraceError
from nnscaler.graph.capture.input_keys import check_input_keys
from nnscaler.graph.capture.library_tracing import static_shape_choices
from nnscaler.graph.capture.user_frames import user_frame

__all__ = [
    "check_forward_args",
    "taken_forward_args",
    "untraced_defaults",
    "export_module",
    "is_data_dependent",
]

_LITERALS = (type(None), bool, int, float, str)
_DATA_DEPENDENT = ("data-dependent", "data dependent", "GuardOnDataDependentSymNode", "Could not guard on")


def is_data_dependent(exc: BaseException) -> bool:
    """Whether a capture failure (or what caused it) is torch.export refusing data-dependent Python."""
    seen: list[BaseException] = []
    while exc is not None and exc not in seen:
        seen.append(exc)
        if any(key in str(exc) for key in _DATA_DEPENDENT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def check_forward_args(module: torch.nn.Module, dummy_forward_args: dict[str, Any]) -> list[str]:
    """Check dummy args against forward's signature; return the names traced, in signature order."""
    if not isinstance(dummy_forward_args, dict):
        raise TraceError(
            f"dummy_forward_args must be a dict of forward argument name -> value, got "
            f"{type(dummy_forward_args).__name__}"
        )
    sig = inspect.signature(module.forward)
    params = sig.parameters
    names = []
    for name, p in params.items():
        if p.kind == p.POSITIONAL_ONLY:
            raise TraceError(
                f"{type(module).__name__}.forward has positional-only argument {name!r}; not supported"
            )
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if name in dummy_forward_args:
            names.append(name)
        elif p.default is p.empty:
            raise TraceError(
                f"dummy_forward_args is missing forward argument {name!r} of "
                f"{type(module).__name__}.forward{sig}: add a dummy value for it"
            )
    has_var_kw = any(p.kind == p.VAR_KEYWORD for p in params.values())
    # a key named like the *args / **kwargs parameter itself (`kwargs`) goes into **kwargs too
    var = {n for n, p in params.items() if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    unknown = [k for k in dummy_forward_args if k not in params or k in var]
    if unknown and not has_var_kw:
        _warn_untaken(module, unknown, sig)
        return names
    check_input_keys(type(module).__name__, unknown, unknown, sig)
    return names + unknown


def _warn_untaken(module: torch.nn.Module, unknown: list[str], sig: inspect.Signature) -> None:
    warnings.warn(
        f"dummy_forward_args keys {unknown} are ignored: {type(module).__name__}.forward{sig} does not "
        "take them (nnScaler 0.8's rule; remove them to silence this)",
        stacklevel=3,
    )


def taken_forward_args(module: torch.nn.Module, dummy_forward_args: dict[str, Any]) -> dict[str, Any]:
    """`dummy_forward_args` without the keys forward does not take (each named in a warning), as
    nnScaler 0.8 ignores them; other mistakes raise TraceError (see check_forward_args)."""
    if not isinstance(dummy_forward_args, dict):
        return dummy_forward_args  # check_forward_args says what is wrong
    # inspect.Parameter.empty is "no value" (nnScaler 0.8 reads it so): a dict built from forward's
    # signature, `{k: p.default ...}` as its huggingface_nlp example does, gives it for **kwargs
    dummy_forward_args = {k: v for k, v in dummy_forward_args.items() if v is not inspect.Parameter.empty}
    taken = check_forward_args(module, dummy_forward_args)
    return {k: v for k, v in dummy_forward_args.items() if k in taken}


def untraced_defaults(module: torch.nn.Module, traced: list[str]) -> dict[str, Any]:
    """Forward parameters not traced whose defaults are plain literals (kept in the generated signature)."""
    out = {}
    for name, p in inspect.signature(module.forward).parameters.items():
        if name in traced or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is p.empty:
            continue
        if isinstance(p.default, _LITERALS):
            out[name] = p.default
    return out


def _user_frame(exc: BaseException) -> str:
    """The innermost traceback frame outside torch/nnscaler: where the user's code failed."""
    frame = user_frame(traceback.extract_tb(exc.__traceback__))
    if frame is not None:
        return f'File "{frame.filename}", line {frame.lineno}, in {frame.name}: {frame.line}'
    text = str(exc)
    m = re.search(r'File "([^"]+)", line (\d+)', text)
    return m.group(0) if m else "unknown location"


def export_module(
    module: torch.nn.Module, kwargs: dict[str, Any], dynamic_shapes: dict[str, Any] | None = None
) -> torch.export.ExportedProgram:
    """torch.export the module; turn capture failures into TraceErrors that name the user's source line.

    With `dynamic_shapes`, a model that cannot be traced with sizes left open is traced again with
    fixed sizes, with a warning saying why (the generated code then accepts only the traced shapes).
    """
    reason = None
    if dynamic_shapes is not None:
        try:
            with static_shape_choices(kwargs):
                return torch.export.export(
                    module, (), kwargs=kwargs, strict=False, dynamic_shapes=dynamic_shapes
                )
        except Exception as exc:  # noqa: BLE001 - retried with fixed sizes below
            first = (str(exc).splitlines() or [type(exc).__name__])[0]
            reason = f"{first}, at {_user_frame(exc)}"
            _clear_dim_marks(kwargs)
    try:
        with static_shape_choices(kwargs):
            ep = torch.export.export(module, (), kwargs=kwargs, strict=False)
        if reason is not None:
            warnings.warn(
                f"{type(module).__name__} could not be traced with input sizes left open ({reason}); traced "
                "with the dummy inputs' sizes fixed instead: calls must use the same shapes"
            )
        return ep
    except Exception as exc:  # noqa: BLE001 - every capture failure is re-raised with context
        msg = str(exc)
        where = _user_frame(exc)
        if any(key in msg for key in _DATA_DEPENDENT):
            raise TraceError(
                f"forward has data-dependent control flow at {where}: a Python `if`/loop on tensor values "
                "cannot be captured. Rewrite it with tensor ops (torch.where, masking) or move the "
                f"decision out of forward. torch.export said: {msg.splitlines()[0]}"
            ) from exc
        raise TraceError(
            f"torch.export could not capture the model at {where}: {msg.splitlines()[0]}"
        ) from exc


def _clear_dim_marks(kwargs: dict[str, Any]) -> None:
    """Forget the dynamic-dim marks a failed export left on the inputs (`_dynamo_weak_dynamic_indices`
    ...): the retry with fixed sizes would otherwise trace those dims open again, and fail the same way."""
    from torch.utils import _pytree as pytree

    for leaf in pytree.tree_leaves(kwargs):
        if isinstance(leaf, torch.Tensor):
            for key in [k for k in vars(leaf) if k.startswith(("_dynamo_", "_has_dynamo_"))]:
                delattr(leaf, key)
