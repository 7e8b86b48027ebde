"""`model.parallel_modules`: parallelize only some sub-modules; the rest of the model stays plain.

Each sub-module of a listed type (the outermost ones) is replaced by its ParallelModule, compiled
with the global compute_config overlaid by the entry's own (end-to-end mode off: the outer forward
calls it). A step then runs the plain loop: `loss = model(**sample)`, backward per micro-batch
(gradient reduction deferred to the last one), and the optimizer from `build_optimizer` averages the
gradients of the outer parameters over all ranks.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Any

import torch
from torch import nn

from nnscaler.cli.loading import load_type
from nnscaler.cli.state import to_device
from nnscaler.cli.tracing_weights import load_sub_module_weights
from nnscaler.errors import ConfigError
from nnscaler.parallel import parallelize
from nnscaler.runtime import ParallelModule, runtime_device

__all__ = ["parallelize_sub_modules", "parallel_parts", "plan_of", "run_micro_batches", "infer_micro_batches"]


def parallel_parts(model: nn.Module) -> list[tuple[str, ParallelModule]]:
    """`(name, module)` of every ParallelModule in `model` (itself included)."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, ParallelModule)]


def plan_of(model: nn.Module) -> str:
    """The plan id of a ParallelModule, or of the ParallelModules inside a mixed model."""
    if isinstance(model, ParallelModule):
        return model.plan_id
    return json.dumps({n: pm.plan_id for n, pm in parallel_parts(model)}, sort_keys=True)


def parallelize_sub_modules(args: Any, model: nn.Module, compile_only: bool) -> nn.Module:
    """Replace the sub-modules `args.model.parallel_modules` lists by their ParallelModules."""
    cc = args.compute_config
    if args.param_dtype is not None:  # the plain parts too (precision), as nnScaler 0.8 casts the model
        model.to(args.param_dtype)
    # as nnScaler 0.8: a listed module inside another listed one is parallelized with it, not apart
    listed = tuple(load_type(e.type) for e in args.model.parallel_modules)
    inside = {n for n, m in model.named_modules() if n and type(m) in listed}
    for entry in args.model.parallel_modules:
        cls = load_type(entry.type)
        found = [(n, m) for n, m in model.named_modules() if n and type(m) is cls]
        if not found:
            raise ConfigError(
                f"model.parallel_modules: {args.model.type} has no sub-module of type {entry.type}"
            )
        outermost = [(n, m) for n, m in found if not any(n.startswith(f"{o}.") for o in inside)]
        # floating inputs in the run's input dtype, as the training samples will be (bf16 runs)
        dummy = to_device(load_type(entry.forward_args_gen_fn)(args), torch.device("cpu"), args.input_dtype)
        sub_cc = (
            entry.compute_config.resolve(cc)
            if entry.compute_config
            else dataclasses.replace(cc, use_end2end=False)
        )
        policy = entry.pas_policy or args.pas_policy
        for name, sub in outermost:
            load_sub_module_weights(args, entry, sub)
            base = entry.instance_name or args.instance_name
            pm = parallelize(
                sub,
                dummy,
                load_type(policy) if "." in policy else policy,
                sub_cc,
                gen_savedir=entry.gen_savedir or args.gen_savedir,
                reuse=entry.gen_reuse or args.gen_reuse,
                instance_name=f"{base}_{name}" if base else name.replace(".", "_"),
                load_module=not compile_only,
                module_dtype=args.param_dtype,
                broadcast_strategy="none"
                if compile_only
                else (entry.broadcast_strategy or args.broadcast_strategy),
                verify=args.verify,
            )
            if not compile_only:
                parent_name, _, attr = name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                setattr(parent, attr, pm)
    return model


def model_device(model: nn.Module) -> torch.device:
    for _, pm in parallel_parts(model):
        return pm.device
    return runtime_device()


def _loss(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output[0]


def run_micro_batches(model: nn.Module, samples: list[Any], scale: float | None) -> list[torch.Tensor]:
    """Forward and backward over `samples` (dicts of forward arguments); reductions wait for the last."""
    parts = [pm for _, pm in parallel_parts(model)]
    losses = []
    for i, sample in enumerate(samples):
        with contextlib.ExitStack() as stack:
            if i < len(samples) - 1:
                for pm in parts:
                    stack.enter_context(pm.no_sync())
            loss = _loss(model(**sample))
            (loss * scale if scale is not None else loss).backward()
        losses.append(loss.detach())
    return losses


def infer_micro_batches(model: nn.Module, samples: list[Any]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [_loss(model(**sample)).detach() for sample in samples]
