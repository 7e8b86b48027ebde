"""The checks of `python -m nnscaler.plan`'s flags: every value either applies or is refused.

A refusal is a `FlagError` naming the flag, the value and the fix; `nnscaler.cli.plan.main` prints it as
one line and exits with status 2 (never a traceback). The checks run before the model is traced, except
the `--at` size names, which are known only from the traced graph (checked before the search).
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
from pathlib import Path
from typing import Any, NoReturn

from nnscaler.errors import ConfigError

__all__ = ["FlagError", "FlagParser", "check_flags", "check_cluster_fit", "parse_sizes", "parse_mesh"]

EXIT_USAGE = 2
"""argparse's exit status for a usage error; the CLI uses it for every refused flag."""


class FlagError(ConfigError):
    """A flag of a command has a value that cannot apply; the message names the flag."""

    def __init__(self, flag: str, value: Any, why: str):
        shown = "" if value is None else f" {value}"
        super().__init__(f"{flag}{shown}: {why}")
        self.flag = flag


class FlagParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors are two lines (the error, then where to look), not the
    whole usage text."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n(see {self.prog} --help)\n")


def parse_sizes(spec: str) -> dict[str, int]:
    """'idx_size0=16,targets_size0=16' -> {name: size} (sizes >= 1); FlagError for --at otherwise."""
    try:
        sizes = {k.strip(): int(v) for k, v in (item.split("=") for item in spec.split(",") if item.strip())}
    except ValueError:
        sizes = {}
    if not sizes or any(not k or v < 1 for k, v in sizes.items()):
        raise FlagError(
            "--at", repr(spec), "give NAME=SIZE pairs (sizes >= 1) separated by commas, e.g. idx_size0=16"
        )
    return sizes


def parse_mesh(spec: str) -> list[int]:
    """'2x4' -> [2, 4] (two or three axes, each > 1); an argparse type."""
    try:
        mesh = [int(v) for v in spec.lower().split("x")]
    except ValueError:
        mesh = []
    if len(mesh) not in (2, 3) or min(mesh) < 2:
        raise argparse.ArgumentTypeError(
            f"{spec!r}: give two or three axis sizes, each 2 or more, as AxB or AxBxC, e.g. 2x4"
        )
    return mesh


def _positive(args: argparse.Namespace, name: str, flag: str, *, number: bool = False) -> None:
    value = getattr(args, name)
    if value is None:
        return
    if (number and not math.isfinite(value)) or value <= 0:
        what = "a positive, finite number" if number else "a positive integer"
        raise FlagError(flag, value, f"must be {what}")


def _out_path(value: str | None, flag: str) -> None:
    if value is None:
        return
    path = Path(value)
    if not value.strip() or path.is_dir():
        raise FlagError(flag, repr(value), "name a file to write (this is a directory or empty)")
    if not path.parent.is_dir():
        raise FlagError(flag, repr(value), f"its directory {path.parent} does not exist: create it first")


def _hf_config(value: str) -> None:
    path = Path(value)
    if not path.is_file():
        raise FlagError("--hf-config", value, "no such file: give a transformers config.json")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FlagError("--hf-config", value, f"not a JSON file ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise FlagError(
            "--hf-config", value, 'a transformers config.json needs a "model_type" (e.g. "llama")'
        )
    from transformers import CONFIG_MAPPING

    if data["model_type"] not in CONFIG_MAPPING:
        raise FlagError(
            "--hf-config",
            value,
            f"model_type {data['model_type']!r} is not known to the installed transformers",
        )


def _model(value: str) -> None:
    module, _, name = value.replace(":", ".").rpartition(".")
    if not module:
        raise FlagError("--model", repr(value), "give a dotted path 'package.module.builder'")
    try:
        builder = getattr(importlib.import_module(module), name)
    except ImportError as err:
        raise FlagError("--model", repr(value), f"cannot import {module} ({err})") from None
    except AttributeError:
        raise FlagError("--model", repr(value), f"{module} has no {name!r}") from None
    if not callable(builder):
        raise FlagError("--model", repr(value), "name a callable returning (module, dummy inputs)")


def check_flags(args: argparse.Namespace) -> None:
    """Every flag that does not need the cluster or the traced model; FlagError on the first bad one."""
    if args.model and args.hf_config:
        raise FlagError("--hf-config", args.hf_config, "give --model or --hf-config, not both")
    if not args.model and not args.hf_config:
        raise FlagError("--model", None, "give --model <dotted builder> or --hf-config <config.json>")
    if args.seq is not None and not args.hf_config:
        raise FlagError(
            "--seq", args.seq, "applies only with --hf-config (a --model builder makes its own inputs)"
        )
    for name in ("devices", "plan_ngpus", "max_plan_ngpus", "batch", "seq", "nmicros"):
        _positive(args, name, "--" + name.replace("_", "-"))
    _positive(args, "mem", "--mem", number=True)
    if args.plan_ngpus and args.max_plan_ngpus:
        raise FlagError(
            "--max-plan-ngpus", args.max_plan_ngpus, "has no effect with --plan-ngpus: give one of them"
        )
    if args.mesh and args.plan_ngpus and math.prod(args.mesh) != args.plan_ngpus:
        raise FlagError(
            "--plan-ngpus",
            args.plan_ngpus,
            f"contradicts --mesh {'x'.join(map(str, args.mesh))} (the plan size is the mesh's product, "
            f"{math.prod(args.mesh)}): leave --plan-ngpus out",
        )
    if args.devices and args.plan_ngpus and args.devices % args.plan_ngpus:
        raise FlagError("--plan-ngpus", args.plan_ngpus, f"must divide --devices {args.devices}")
    if args.recompute is not None and not args.recompute.strip():
        raise FlagError(
            "--recompute", repr(args.recompute), "name the modules to recompute (comma-separated)"
        )
    _out_path(args.save_plan, "--save-plan")
    _out_path(args.out, "--out")
    for spec in args.at:
        parse_sizes(spec)
    if args.hf_config:
        _hf_config(args.hf_config)
    if args.model:
        _model(args.model)


def check_cluster_fit(args: argparse.Namespace, ndevices: int) -> None:
    """The device counts against the loaded cluster's `ndevices`."""
    devices = args.devices or ndevices
    if args.devices and args.devices > ndevices:
        raise FlagError(
            "--devices",
            args.devices,
            f"the --cluster has {ndevices} devices: describe more nodes, or plan for fewer",
        )
    plan = args.plan_ngpus or (math.prod(args.mesh) if args.mesh else None)
    if plan and devices % plan:
        flag = "--plan-ngpus" if args.plan_ngpus else "--mesh"
        raise FlagError(flag, plan, f"the plan size must divide the {devices} devices planned for")
