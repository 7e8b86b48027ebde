"""The command-line grammar of the trainer, and turning plain dicts into typed dataclasses.

    parse_args(["--a.b=1", "--c", "2", "--flag"])  -> {"a": {"b": "1"}, "c": "2", "flag": None}
    merge_args(cfg, ["--model.args.dim", "32", "--global_batch_size!"])   # overrides; `!` deletes
    resolve_args(cfg)               # "$(vars.dim)" / "${vars.dim}" become the referenced values
    deserialize_dataclass(cfg, TrainerArgs)    # strings converted by the fields' type hints

Grammar (nnScaler's): `--a.b.c value` or `--a.b.c=value`; dashes in keys become underscores; dots
nest; a list element is addressed by its index (`--model.parallel_modules.0.type X`); `--key!`
deletes a key (and a later `--key.x v` starts it afresh); a flag without a value is `None` (True
for a bool field). Values stay strings until `deserialize_dataclass` converts them by type hint; a
field without a usable hint (Any, a union of several types) gets `ast.literal_eval` of the string
when that parses (`'[1,2]'` -> list, `'3'` -> int), else the string.

`$(a.b)` / `${a.b}` refer to another entry of the same config (list items by index), or, when no
such entry exists, to an environment variable of that name. A value that is exactly one reference
takes the referenced value with its type (a deep copy); references inside a longer string are
formatted with `str`. `$\\(` and `$\\{` stand for a literal `$(` / `${`.
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import difflib
import enum
import os
import re
import sys
import types
import typing
from typing import Any, Union

from nnscaler.errors import ConfigError

__all__ = [
    "parse_args",
    "merge_args",
    "resolve_args",
    "deserialize_dataclass",
    "TYPE_KEY",
    "VALUE_TYPE_KEY",
    "VALUE_KEY",
    "DESERIALIZE_KEY",
    "NORMALIZE_KEY",
    "SKIP_DESERIALIZATION_KEY",
]

TYPE_KEY = "__type"
"""In a dict of arguments: the dotted name of a callable that builds the object from the other keys."""
VALUE_TYPE_KEY = "__value_type"
"""With `value`: the dotted name of a type called with the value (`function`: the value is a name)."""
VALUE_KEY = "value"

DESERIALIZE_KEY = "deserialize"
"""Field metadata: a function whose result is assigned to the field as it is."""
NORMALIZE_KEY = "normalize"
"""Field metadata: a function applied before the usual conversion."""
SKIP_DESERIALIZATION_KEY = "skip_deserialization"
"""Field metadata: pass the raw value through (the dataclass's __post_init__ handles it)."""

_REF = re.compile(r"\$\{([^}]+)\}|\$\(([^)]+)\)")


class _KeyNotFoundError(KeyError):
    """A `$(...)` reference names an entry that does not exist (and no environment variable)."""


# ---------------------------------------------------------------------------------------------
# parsing and merging
# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> dict[str, Any]:
    """`--a.b=v` / `--a.b v` / `--flag` arguments as a nested dict of strings (None for a bare flag)."""
    flat: dict[str, Any] = {}
    pending: str | None = None
    for arg in argv:
        if isinstance(arg, str) and arg.startswith("--"):
            key, sep, value = arg[2:].partition("=")
            if not key:
                raise ConfigError(f"invalid argument {arg!r}: expected --key or --key=value")
            flat[key] = value if sep else None
            pending = None if sep else key
        elif pending is None:
            raise ConfigError(
                f"invalid argument {arg!r}: a value must follow a --key (e.g. --max_train_steps 10); "
                "a config file is given first, as -f cfg.yaml"
            )
        else:
            flat[pending] = arg
            pending = None
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        parts = key.replace("-", "_").split(".")
        node = nested
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(
                    f"--{'.'.join(parts[: i + 1])} is given a value and also used as a group in --{key}"
                )
            node = child
        node[parts[-1]] = value
    return nested


def merge_args(args: dict[str, Any], argv: list[str]) -> None:
    """Apply command-line overrides `argv` to `args` in place (`--key!` deletes `key`)."""
    _merge(args, parse_args(argv))


def _deleted(key: Any) -> bool:
    return isinstance(key, str) and key.endswith("!")


def _is_index(key: Any) -> bool:
    if isinstance(key, int):
        return True
    return isinstance(key, str) and (key.isdigit() or (_deleted(key) and key[:-1].isdigit()))


def _merge(args: dict[Any, Any], new: dict[Any, Any]) -> None:
    for key, value in new.items():
        if _deleted(key):
            args.pop(key, None)
            args.pop(key[:-1], None)
            continue
        old = args.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            _merge(old, value)
        elif isinstance(old, list) and isinstance(value, dict) and all(_is_index(k) for k in value):
            by_index = {str(i): item for i, item in enumerate(old)}
            _merge(by_index, {str(k): v for k, v in value.items()})
            items = {int(k): v for k, v in by_index.items()}
            merged = [None] * (max(items) + 1 if items else 0)
            for i, item in items.items():
                merged[i] = item
            args[key] = merged
        elif isinstance(value, dict):
            fresh = copy.deepcopy(value)
            _merge(fresh, value)  # applies deletions inside the new group
            args[key] = fresh
        else:
            args[key] = value


# ---------------------------------------------------------------------------------------------
# $(...) references
# ---------------------------------------------------------------------------------------------


def resolve_args(args: dict[str, Any]) -> None:
    """Replace every `$(a.b)` / `${a.b}` in `args` (in place) by the referenced value.

    Raises `_KeyNotFoundError` (a KeyError) for a reference to nothing, ValueError for a cycle."""
    done: set[tuple[str, ...]] = set()
    active: set[str] = set()

    def lookup(ref: str) -> tuple[list[str], Any]:
        parts = ref.split(".")
        node: Any = args
        for part in parts:
            if isinstance(node, list) and part.isdigit() and int(part) < len(node):
                node = node[int(part)]
            elif isinstance(node, dict) and part in node:
                node = node[part]
            else:
                raise _KeyNotFoundError(
                    f"$({ref}) refers to a key that is not in the config (nor an environment variable)"
                )
        return parts, node

    def store(parts: list[Any], value: Any) -> None:
        node: Any = args
        for part in parts[:-1]:
            node = node[int(part)] if isinstance(node, list) else node[part]
        if isinstance(node, list):
            node[int(parts[-1])] = value
        else:
            node[parts[-1]] = value

    def value_of(ref: str) -> Any:
        if ref in active:
            raise ConfigError(f"circular reference: $({ref}) refers back to itself")
        try:
            parts, raw = lookup(ref)
        except _KeyNotFoundError:
            if ref in os.environ:
                return os.environ[ref]
            raise
        active.add(ref)
        try:
            return resolve(raw, parts)
        finally:
            active.discard(ref)

    def resolve(value: Any, path: list[Any]) -> Any:
        key = tuple(str(p) for p in path)
        if isinstance(value, dict):
            for k in list(value):
                resolve(value[k], [*path, k])
            return value
        if isinstance(value, list):
            for i in range(len(value)):
                resolve(value[i], [*path, i])
            return value
        if not isinstance(value, str) or key in done:
            return value
        whole = _REF.fullmatch(value)
        if whole:
            out = copy.deepcopy(value_of(whole.group(1) or whole.group(2)))
        else:
            out = _REF.sub(lambda m: str(value_of(m.group(1) or m.group(2))), value)
            out = out.replace("$\\(", "$(").replace("$\\{", "${")
        if path:
            store(path, out)
        done.add(key)
        return out

    resolve(args, [])


# ---------------------------------------------------------------------------------------------
# dict -> dataclass
# ---------------------------------------------------------------------------------------------


def _fix_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (Union, types.UnionType):
        members = typing.get_args(hint)
        rest = [m for m in members if m is not type(None)]
        if len(members) != 2 or len(rest) != 1:
            return Any  # several types allowed: no conversion, the value is guessed
        return _fix_optional(rest[0])
    return hint


def _allows_none(hint: Any) -> bool:
    return typing.get_origin(hint) in (Union, types.UnionType) and type(None) in typing.get_args(hint)


def _fix_type(hint: Any, raise_on_nested: bool = True) -> Any:
    """`Optional[X]` -> X; Any and multi-type unions -> None; nested generics raise if asked."""
    hint = _fix_optional(hint)
    if hint is Any:
        return None
    if raise_on_nested and typing.get_args(hint):
        raise ValueError(f"nested type {hint} is not supported here")
    return hint


@dataclasses.dataclass
class _TypeInfo:
    type: Any = None
    key_type: Any = None
    value_type: Any = None
    item_type: Any = None
    metadata: Any = dataclasses.field(default_factory=dict)


def _type_info(hint: Any) -> _TypeInfo:
    hint = _fix_type(hint, False)
    if hint is None:
        return _TypeInfo()
    if hint in (list, typing.List):  # noqa: UP006
        return _TypeInfo(type=list)
    if hint in (dict, typing.Dict):  # noqa: UP006
        return _TypeInfo(type=dict)
    if hint in (tuple, typing.Tuple):  # noqa: UP006
        return _TypeInfo(type=tuple)
    origin, targs = typing.get_origin(hint), typing.get_args(hint)
    if origin is list:
        return _TypeInfo(type=list, item_type=_fix_type(targs[0]))
    if origin is dict:
        return _TypeInfo(type=dict, key_type=_fix_type(targs[0]), value_type=_fix_type(targs[1]))
    if origin is tuple:
        if len(targs) != 2 or targs[1] is not Ellipsis:
            raise ValueError(f"unsupported tuple type {hint}: use Tuple[X, ...]")
        return _TypeInfo(type=tuple, item_type=_fix_type(targs[0]))
    if origin is typing.Literal:
        return _TypeInfo(type=type(targs[0]))
    if origin is not None or getattr(hint, "__module__", None) == "typing":
        return _TypeInfo()  # something we do not convert (Callable, ...): passed through
    return _TypeInfo(type=hint)


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # a local class with string annotations: resolve what we can
        module = vars(sys.modules.get(cls.__module__, types.ModuleType("_")))
        out = {}
        for f in dataclasses.fields(cls):
            try:
                out[f.name] = eval(f.type, module) if isinstance(f.type, str) else f.type  # noqa: S307
            except Exception:
                out[f.name] = Any
        return out


def _guess(value: Any) -> Any:
    """A value without a usable type hint: parse strings as Python literals where they are."""
    if isinstance(value, dict):
        if VALUE_KEY in value and VALUE_TYPE_KEY in value and len(value) == 2:
            return value
        return {_guess(k): _guess(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_guess(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_guess(v) for v in value)
    if isinstance(value, str):
        if value in ("true", "false"):
            return value == "true"
        try:
            return ast.literal_eval(value)
        except Exception:
            return value
    return value


def _convert(value: Any, target: Any, where: str) -> Any:
    if not target or target in (dict, list, tuple):
        return _guess(value)
    if value is None or (isinstance(target, type) and isinstance(value, target)):
        if not (target is int and isinstance(value, bool)):
            return value
    if dataclasses.is_dataclass(target):
        return deserialize_dataclass(value, target, _where=where)
    try:
        if isinstance(target, type) and issubclass(target, enum.Enum):
            try:
                return target[value]
            except KeyError:
                return target(value)
        if target is bool:
            text = str(value).lower()
            if text in ("true", "1", "yes"):
                return True
            if text in ("false", "0", "no"):
                return False
            raise ValueError(value)
        if target in (int, float, str):
            if target is int and isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return target(value)
    except (ValueError, TypeError, KeyError):
        name = getattr(target, "__name__", str(target))
        raise ConfigError(f"{where}: expected {name}, got {value!r}") from None
    return value


def _literal(value: str, where: str, kind: type) -> Any:
    try:
        return ast.literal_eval(value)
    except Exception:
        raise ConfigError(f"{where}: expected a {kind.__name__} literal, got {value!r}") from None


def deserialize_dataclass(value: Any, value_type: type, *, _where: str = "") -> Any:
    """Build `value_type` (a dataclass) from a nested dict, converting by the fields' type hints.

    Raises ConfigError (a ValueError) naming the dotted field for an unknown key (with the closest
    known name) or a value of the wrong type."""
    name = value_type.__name__ if isinstance(value_type, type) else str(value_type)
    if not dataclasses.is_dataclass(value_type):
        raise ConfigError(f"{_where or name}: {value_type} is not a dataclass")
    if not isinstance(value, dict):
        raise ConfigError(f"{_where or name}: expected a mapping of {name}'s fields, got {value!r}")
    hints = _hints(value_type)
    fields = {f.name: f for f in dataclasses.fields(value_type) if f.init}
    unknown = [k for k in value if k not in fields]
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(str(key), list(fields), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; known fields: {', '.join(fields)}"
        prefix = f"{_where}." if _where else ""
        raise ConfigError(f"unknown field {prefix}{key} in {name}{hint}")
    members: dict[str, Any] = {}
    for key, f in fields.items():
        if key not in value:
            continue
        where = f"{_where}.{key}" if _where else key
        v = value[key]
        meta = f.metadata
        if DESERIALIZE_KEY in meta:
            members[key] = meta[DESERIALIZE_KEY](v)
            continue
        if meta.get(SKIP_DESERIALIZATION_KEY):
            members[key] = v
            continue
        if NORMALIZE_KEY in meta:
            v = meta[NORMALIZE_KEY](v)
        hint = hints.get(key, Any)
        ti = _type_info(hint)
        if ti.type is bool and v is None and not _allows_none(hint):
            v = True  # a bare flag (an Optional[bool] keeps None: its default, so to_dict round-trips)
        if v is None:
            continue
        if ti.type in (list, tuple, dict) and isinstance(v, str):
            v = _literal(v, where, ti.type)
        if isinstance(v, (list, tuple, dict)) and not ti.type:
            ti.type = type(v)
        if ti.type in (list, tuple) and (ti.item_type or isinstance(v, dict)):
            if isinstance(v, dict):
                by_index = {int(_convert(k, int, where)): x for k, x in v.items()}
                v = [by_index.get(i) for i in range(max(by_index) + 1 if by_index else 0)]
            if not isinstance(v, (list, tuple)):
                raise ConfigError(f"{where}: expected a list, got {v!r}")
            v = ti.type(_convert(x, ti.item_type, f"{where}.{i}") for i, x in enumerate(v))
        elif ti.type is dict and (ti.key_type or ti.value_type):
            if not isinstance(v, dict):
                raise ConfigError(f"{where}: expected a mapping, got {v!r}")
            v = {
                _convert(k, ti.key_type, where): _convert(x, ti.value_type, f"{where}.{k}")
                for k, x in v.items()
            }
        else:
            v = _convert(v, ti.type, where)
        if v is not None:
            members[key] = v
    try:
        return value_type(**members)
    except ConfigError as err:
        if _where and not str(err).startswith(_where):  # name the field by its dotted path (same type)
            err.args = (f"{_where}: {err}", *err.args[1:])
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"{_where or name}: {err}") from err
