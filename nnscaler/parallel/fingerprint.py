"""What decides whether generated code can be reused, and what differs when it cannot.

A fingerprint is a JSON-able dict of everything that shapes the generated code:

- the model: its class, train/eval mode, the source of every module class in it (whole MRO,
  torch's own excluded) and of the helpers those classes call from the model's own package
  (see `nnscaler.parallel.sources`), the versions of installed model packages, and the names,
  shapes and dtypes of its parameters and buffers (never their values), and the values of the plain
  attributes of every submodule (`scale=2.0`, a config's `rms_norm_eps`; see
  `nnscaler.parallel.attributes`);
- the dummy inputs: structure, shapes and dtypes of tensors, values of plain Python arguments;
- the policy (its name, and its source when it is a callable) and the ComputeConfig (pas_config
  included);
- the nnscaler and torch versions.

`GRAPH_KEYS` are the parts that shape the traced graph: `reuse='graph'` checks only those (and
the saved graph itself, `check_graph`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any

import torch

from nnscaler.config import ComputeConfig
from nnscaler.errors import ConfigError
from nnscaler.graph.ir import Graph
from nnscaler.parallel.attributes import attribute_values
from nnscaler.parallel.resolved_policy import ResolvedPolicy, resolve_pas_policy
from nnscaler.parallel.sources import digest, helper_sources, module_sources, package_versions

__all__ = ["fingerprint", "describe_differences", "check_graph", "GRAPH_KEYS", "FORMAT"]

FORMAT = 4
"""Bumped when the fingerprint's layout changes (an older one then never matches). 3: the saved
fingerprint records the sha256 of every generated file (nnscaler.parallel.artifacts). 4: the values
of the model's attributes (`attributes`)."""

GRAPH_KEYS = (
    "python",
    "torch",
    "module",
    "training",
    "module_sources",
    "helper_sources",
    "packages",
    "parameters",
    "buffers",
    "attributes",
    "dummy_forward_args",
)
"""Fingerprint parts the traced graph depends on (plus ComputeConfig.constant_folding)."""

_PRIMITIVES = (bool, int, float, str, bytes, type(None))


def _describe(value: Any) -> Any:
    """The spec of a dummy input: tensors by shape and dtype, plain values by value, others by type."""
    if isinstance(value, torch.Tensor):
        return {"tensor": list(value.shape), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _describe(v) for k, v in value.items()}
    if isinstance(value, _PRIMITIVES):
        return repr(value)
    if isinstance(value, torch.dtype):
        return str(value)
    return f"<{type(value).__module__}.{type(value).__qualname__}>"


def _policy(policy: ResolvedPolicy) -> dict[str, Any]:
    """A built-in policy by name (its code is covered by the nnscaler version), a custom one with its source."""
    return {"name": policy.name, "source": None if policy.builtin else digest(policy.fn)}


def fingerprint(
    module: torch.nn.Module,
    dummy_forward_args: dict,
    policy: str | Callable | ResolvedPolicy,
    cfg: ComputeConfig,
    version: str,
) -> dict[str, Any]:
    """A JSON-able description; generated code is reused only when it is equal. `policy` as parallelize
    resolved it (a name or callable is resolved here, and cfg.pas_config validated for it)."""
    policy = resolve_pas_policy(policy, cfg.pas_config)
    klass = type(module)
    return {
        "format": FORMAT,
        "nnscaler": version,
        "torch": torch.__version__,
        "python": ".".join(map(str, sys.version_info[:3])),
        "module": f"{klass.__module__}.{klass.__qualname__}",
        "training": module.training,
        "module_sources": module_sources(module),
        "helper_sources": helper_sources(module),
        "packages": package_versions(module),
        "parameters": {
            name: [list(p.shape), str(p.dtype).removeprefix("torch."), p.requires_grad]
            for name, p in module.named_parameters(remove_duplicate=False)
        },
        "buffers": {
            name: [list(b.shape), str(b.dtype).removeprefix("torch.")]
            for name, b in module.named_buffers(remove_duplicate=False)
        },
        "attributes": attribute_values(module),
        "dummy_forward_args": _describe(dummy_forward_args),
        "policy": _policy(policy),
        "compute_config": json.loads(json.dumps(cfg.to_dict(), default=str)),
    }


# ---- what differs --------------------------------------------------------------------------------


def _short(value: Any, quote: bool = True) -> str:
    text = json.dumps(value, default=str) if quote else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _dict_diff(old: dict, new: dict, changed: str, added: str, removed: str, quote: bool = True) -> list[str]:
    out = [
        changed.format(k, _short(old[k], quote), _short(new[k], quote))
        for k in old
        if k in new and old[k] != new[k]
    ]
    out += [added.format(k) for k in new if k not in old]
    out += [removed.format(k) for k in old if k not in new]
    return out


def _flat(value: Any, path: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and "tensor" not in value:
        items = value.items()
    elif isinstance(value, list) and not (path and all(isinstance(v, int) for v in value)):
        items = enumerate(value)
    else:
        return {path: value}
    out = {}  # an empty container adds nothing: its new items are reported as new
    for k, v in items:
        out.update(_flat(v, f"{path}[{k!r}]" if path else str(k)))
    return out


_PART_TEXTS: dict[str, tuple[str, str, str]] = {
    "module_sources": (
        "source of {} changed",
        "module class {} is new in the model",
        "module class {} is no longer in the model",
    ),
    "helper_sources": (
        "source (or value) of {} changed",
        "the model now uses {}",
        "the model no longer uses {}",
    ),
    "packages": ("package {} version {} -> {}", "package {} is new", "package {} is gone"),
    "parameters": ("parameter {}: [shape, dtype...] {} -> {}", "new parameter {}", "parameter {} is gone"),
    "buffers": ("buffer {}: [shape, dtype...] {} -> {}", "new buffer {}", "buffer {} is gone"),
    "attributes": (
        "model attribute `{}` changed: {} -> {}",
        "model attribute `{}` is new",
        "model attribute `{}` is gone",
    ),
    "dummy_forward_args": ("dummy input {}: {} -> {}", "new dummy input {}", "dummy input {} is gone"),
    "compute_config": ("ComputeConfig.{}: {} -> {}", "ComputeConfig.{} is new", "ComputeConfig.{} is gone"),
}
"""Fingerprint parts compared item by item: how a changed, a new and a gone item reads."""


def _part_differences(key: str, a: Any, b: Any) -> list[str]:
    """One line per item of part `key` (a dict, or nested inputs / config fields) that differs."""
    if key == "dummy_forward_args":
        a, b = _flat(a), _flat(b)
    elif key == "compute_config":
        a, b = _flat(a or {}), _flat(b or {})
    else:
        a, b = a or {}, b or {}
    return _dict_diff(a, b, *_PART_TEXTS[key], quote=key != "attributes")


def _whole_difference(key: str, a: Any, b: Any) -> str:
    """The line for a part compared as a whole."""
    if key == "python":
        return f"Python {a} -> {b} (model code is compared as compiled by Python)"
    if key == "policy" and (a or {}).get("name") == (b or {}).get("name"):
        return f"source of policy {b['name']} changed"
    if key == "training":
        return f"the model was in {'train' if a else 'eval'} mode, now in {'train' if b else 'eval'} mode"
    return f"{key}: {_short(a)} -> {_short(b)}"


def describe_differences(
    old: dict[str, Any], new: dict[str, Any], keys: tuple[str, ...] | None = None
) -> list[str]:
    """One line per difference, naming the class, parameter, input or field (e.g.
    "source of mypkg.attn.Attention changed"); `keys` limits the comparison to those parts."""
    if old.get("format") != new.get("format"):
        return [f"the saved fingerprint has format {old.get('format')!r}, this nnscaler writes {FORMAT}"]
    other_python = old.get("python") != new.get("python")
    lines: list[str] = []
    for key in keys or tuple(new):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if other_python and key in ("module_sources", "helper_sources"):
            continue  # code is compared as compiled: another Python compiles it differently
        if key in _PART_TEXTS:
            lines += _part_differences(key, a, b)
        else:
            lines.append(_whole_difference(key, a, b))
    return lines


# ---- reuse='graph': does the saved graph belong to this model? -----------------------------------


def check_graph(graph: Graph, saved: dict[str, Any] | None, current: dict[str, Any], where: str) -> None:
    """Raise ConfigError when the saved `graph` (and the fingerprint saved with it) does not match the
    model and dummy inputs described by `current`: class, parameters and buffers (names, shapes,
    dtypes), dummy inputs, module sources, torch version, constant_folding."""
    problems: list[str] = []
    if graph.module_class and graph.module_class != current["module"]:
        problems.append(f"the saved graph is of {graph.module_class}, the model is {current['module']}")
    tensors = {**current["buffers"], **current["parameters"]}
    for v in graph.params() + graph.buffers():
        names = (v.target, *v.aliases)
        found = next((tensors[n] for n in names if n in tensors), None)
        if found is None:
            problems.append(f"the saved graph has {v.kind} {v.target}, which the model does not have")
        elif v.meta is not None and (list(v.meta.shape), v.meta.dtype) != (found[0], found[1]):
            problems.append(
                f"{v.kind} {v.target}: the saved graph has shape {list(v.meta.shape)} {v.meta.dtype}, "
                f"the model {found[0]} {found[1]}"
            )
    args = current["dummy_forward_args"]
    for name in graph.inputs:
        v = graph.values[name]
        spec = args.get(v.target) if isinstance(args, dict) else None
        if isinstance(spec, dict) and "tensor" in spec and v.meta is not None:
            if (list(v.meta.shape), v.meta.dtype) != (spec["tensor"], spec["dtype"]):
                problems.append(
                    f"dummy input {v.target}: the saved graph was traced with shape {list(v.meta.shape)} "
                    f"{v.meta.dtype}, now {spec['tensor']} {spec['dtype']}"
                )
    static = bool(current["compute_config"].get("constant_folding"))
    if graph.static_shapes != static:
        problems.append(
            f"the saved graph has constant_folding={graph.static_shapes}, ComputeConfig has {static}"
        )
    if saved is None:
        problems.append("no fingerprint.json beside the graph, so its module sources cannot be checked")
    else:
        problems += describe_differences(saved, current, GRAPH_KEYS)
    if problems:
        raise ConfigError(
            f"reuse='graph' but the graph saved in {where} does not match this model: "
            + "; ".join(dict.fromkeys(problems))
            + ". Trace it again with reuse='moo' (or 'override'), or use another gen_savedir / instance_name"
        )
