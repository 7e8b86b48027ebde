"""The parity harness (DESIGN.md §4): train a zoo model in parallel and alone, and compare.

    run_parity("gpt", "tp", plan_ngpus=2, runtime_ngpus=4, tmp_path=tmp_path)

`runtime_ngpus` processes each build the model from the same seed, `nnscaler.parallelize` it
with `ComputeConfig(plan_ngpus, runtime_ngpus)`, and train `steps` optimizer steps (AdamW by
default; SGD where the gradient's scale must be checked, see OPTIMIZERS). Data-parallel
replica k (ranks k*plan_ngpus .. (k+1)*plan_ngpus-1) gets batch `make_batch(step*100 + k)` at each
step. Every rank records its loss per step; the ranks' state dicts are gathered and merged with
`nnscaler.merge_state_dicts` on rank 0.

The parent then trains the single-device model on the concatenation of all replicas' batches
(batch dim 0) with the same optimizer, and checks:
- every rank of one replica reports the same loss;
- at each step the mean of the replicas' losses equals the reference loss (gradients are averaged
  across replicas, so this is the same optimisation problem);
- every merged parameter (by its original name) equals the reference parameter.

A builder may freeze parameters (`requires_grad=False`, e.g. tests/zoo_finetune.py): both sides
then train only the others, and each rank also reports which parameters are frozen, whether any of
them got a gradient, which parameters the gradient reducer holds and which the optimizer keeps
state for (`frozen`, `frozen_with_grad`, `reduced`, `optimizer_names`, `optimizer_state_names`).

Only nnscaler's public API is used here: it is the contract between the harness and the compiler.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from tests import zoo
from tests.dist_util import DEFAULT_TIMEOUT, spawn

__all__ = ["run_parity", "run_parity_many", "ParityCase", "train_parallel", "train_reference", "compare"]

SEED = 0
"""Seed of the model weights, in every process."""
DUMMY_SEED = 12345
"""Seed of the dummy batch given to parallelize for tracing."""
ADAMW_PARAM_ATOL = 5e-5
"""Parameter tolerance after AdamW steps: 5% of one step (see OPTIMIZERS)."""
OPTIMIZERS: dict[str, tuple[str, dict[str, Any], float]] = {
    # AdamW divides each gradient by its running magnitude, so where the true gradient is ~0 (an
    # attention key bias: softmax ignores a per-row shift) float round-off becomes an update of up
    # to lr. Different but correct reduction orders then differ by ~3e-6 after 3 steps with the
    # default eps=1e-8 (measured with a DDP-like stand-in), ~4e-7 with eps=1e-6: hence eps=1e-6
    # and atol=1e-5 (1% of one step) for losses. A parameter element whose gradient happens to be
    # ~eps in size still turns 1% round-off into ~1% of a step (gpt2 tp: one attn.c_proj.bias element
    # off by 2.1e-5 after 3 steps), so AdamW parameters get ADAMW_PARAM_ATOL; a wrong gradient moves
    # many elements by ~lr, far beyond it. SGD runs check parameters tightly.
    "adamw": ("AdamW", {"lr": 1e-3, "eps": 1e-6}, 1e-5),
    # AdamW is also blind to the gradient's scale (a sum instead of a mean across replicas gives the
    # same update); SGD is not, so a few SGD runs guard the scale. Its updates are linear in the
    # gradient, so round-off stays round-off (measured ~1e-7).
    "sgd": ("SGD", {"lr": 0.1}, 1e-6),
    # bf16 / fp16 parameters with fp32 master weights and state (run with module_dtype=...): both
    # sides round to bf16 after every step, so they agree to bf16 precision only.
    "mp_adamw": (
        "nnscaler.runtime.grads.mixed_precision.MixedPrecisionAdamW",
        {"lr": 1e-3, "eps": 1e-6},
        1e-2,
    ),
}
"""Optimizers a parity run may use: name -> (torch.optim class name, or a dotted path, keyword
arguments, default atol for parameters)."""


def _make_optimizer(name: str, overrides: dict[str, Any]) -> tuple[type, dict[str, Any]]:
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown parity optimizer {name!r}; known: {sorted(OPTIMIZERS)}")
    cls_name, kwargs, _ = OPTIMIZERS[name]
    if "." in cls_name:
        module, _, attr = cls_name.rpartition(".")
        return getattr(importlib.import_module(module), attr), {**kwargs, **overrides}
    return getattr(torch.optim, cls_name), {**kwargs, **overrides}


def _batch_seed(step: int, replica: int, micro: int | None = None) -> int:
    if micro is not None:  # end-to-end mode: several micro-batches per step
        return (step * 100 + replica) * 100 + micro
    return step * 100 + replica


def _step_batch(make_batch, seed: int, batch_size: int, step: int, shapes) -> dict[str, Any]:
    """The batch of one step: `make_batch(seed, batch_size)`, or with `shapes`, that step's
    (batch size, sequence length): every tensor with a sequence dim (dim 1) is cut to that length."""
    if shapes is None:
        return make_batch(seed, batch_size)
    size, seq = shapes[step]
    batch = make_batch(seed, size)
    if seq is None:
        return batch
    return {
        k: (v[:, :seq].contiguous() if isinstance(v, torch.Tensor) and v.dim() > 1 else v)
        for k, v in batch.items()
    }


def _cat_batches(batches: list[dict[str, Any]]) -> dict[str, Any]:
    """Concatenate forward kwargs along batch dim 0 (non-tensor values must agree)."""
    out: dict[str, Any] = {}
    for key in batches[0]:
        values = [b[key] for b in batches]
        if isinstance(values[0], torch.Tensor):
            out[key] = torch.cat(values, dim=0)
        else:
            if any(v != values[0] for v in values):
                raise ValueError(f"batches disagree on non-tensor argument {key!r}: {values}")
            out[key] = values[0]
    return out


# ---------------------------------------------------------------------------------------------
# the parallel side (runs in every spawned rank)
# ---------------------------------------------------------------------------------------------
def train_parallel(
    rank: int,
    world_size: int,
    model_name: str,
    policy: Any,
    plan_ngpus: int,
    steps: int,
    batch_size: int,
    gen_savedir: str,
    optimizer: str = "adamw",
    optimizer_kwargs: dict[str, Any] | None = None,
    config_kwargs: dict[str, Any] | None = None,
    module_dtype: torch.dtype | None = None,
    merge_optimizer: bool = False,
    nmicros: int | None = None,
    shapes: list[tuple[int, int | None]] | None = None,
) -> dict[str, Any]:
    """One rank's share of a parity run; returns its losses and (rank 0) the merged state dict
    (`merged`) and, with `merge_optimizer`, the merged optimizer state dict (`merged_optimizer`).
    `module_dtype` is passed to parallelize (the module is cast before compiling). `nmicros`: end-to-end
    mode, each step is `pm.train_step(micro_batches)` over that many micro-batches (losses per micro-batch)."""
    import nnscaler
    from nnscaler import ComputeConfig, build_optimizer, merge_state_dicts, parallelize

    # The process group is already up (FileStore, see dist_util); init() must accept that.
    nnscaler.init()

    model, make_batch = zoo.build(model_name, seed=SEED)
    full_numel = sum(p.numel() for p in model.parameters())
    dummy = make_batch(DUMMY_SEED, batch_size)
    cfg = ComputeConfig(plan_ngpus, world_size, **(config_kwargs or {}))
    pm = parallelize(model, dummy, policy, cfg, gen_savedir=gen_savedir, module_dtype=module_dtype)
    opt_cls, opt_kwargs = _make_optimizer(optimizer, optimizer_kwargs or {})
    opt = build_optimizer(pm, opt_cls, **opt_kwargs)

    device = _module_device(pm)
    replica = rank // plan_ngpus
    losses = []
    frozen = {n: p for n, p in _param_names(pm).items() if not p.requires_grad}
    frozen_with_grad: set[str] = set()
    launched_in_backward: list[int] = []
    """End-to-end mode: per train_step, the buckets whose reduction backward launched (overlap)."""
    if nmicros is not None:
        sync_grad = pm.sync_grad

        def counting_sync_grad() -> None:
            red = pm.reducer
            launched_in_backward.append(sum(b.reduced for b in red.buckets) if red is not None else 0)
            sync_grad()

        pm.sync_grad = counting_sync_grad  # train_step calls it right after the schedule
    for step in range(steps):
        if nmicros is not None:
            micro = [
                _to(_step_batch(make_batch, _batch_seed(step, replica, m), batch_size, step, shapes), device)
                for m in range(nmicros)
            ]
            step_losses = pm.train_step(micro)
            frozen_with_grad.update(_with_grad(frozen))
            opt.step()
            opt.zero_grad()
            losses.extend(float(x) for x in step_losses)
            continue
        batch = _to(_step_batch(make_batch, _batch_seed(step, replica), batch_size, step, shapes), device)
        loss = zoo.extract_loss(pm(**batch))
        loss.backward()
        frozen_with_grad.update(_with_grad(frozen))
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().float().item())

    red = pm.reducer
    names = _param_names(pm)
    by_id = {id(p): n for n, p in names.items()}
    opt_sd = opt.state_dict()
    opt_names = [n for g in opt_sd["param_groups"] for n in g["param_names"]]
    state = {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in pm.state_dict().items()}
    opt_state = _cpu_tree(opt.state_dict()) if merge_optimizer else None
    states: list[Any] = [None] * world_size
    dist.all_gather_object(states, (state, opt_state))
    merged = merged_opt = None
    if rank == 0:
        merged, merged_opt = merge_state_dicts(
            [s for s, _ in states], [o for _, o in states] if merge_optimizer else None
        )
        merged = {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in merged.items()}
    result = {
        "rank": rank,
        "replica": replica,
        "losses": losses,
        "merged": merged,
        "launched_in_backward": launched_in_backward,
        "frozen": sorted(frozen),
        "frozen_with_grad": sorted(frozen_with_grad),
        "reduced": sorted(by_id[id(p)] for p in red.params) if red is not None else [],
        "optimizer_names": opt_names,
        "local_param_fraction": sum(p.numel() for p in pm.parameters()) / max(full_numel, 1),
        "optimizer_state_names": sorted(opt_names[int(i)] for i, st in opt_sd["state"].items() if st),
    }
    if merge_optimizer:
        result["merged_optimizer"] = merged_opt
    return result


def _param_names(pm: Any) -> dict[str, torch.nn.Parameter]:
    """Original (single-device) name -> this rank's registered parameter."""
    originals = pm.dist_param_map
    return {originals[local]: p for local, p in pm.named_parameters()}


def _with_grad(params: dict[str, torch.nn.Parameter]) -> list[str]:
    """Names of `params` holding a gradient (`.grad` or a reducer's `.main_grad`)."""
    return [n for n, p in params.items() if p.grad is not None or getattr(p, "main_grad", None) is not None]


def _cpu_tree(value: Any) -> Any:
    """A copy of nested dicts / lists / tuples with every tensor detached, cloned and on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().clone()
    if isinstance(value, dict):
        return {k: _cpu_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu_tree(v) for v in value)
    return value


def _module_device(module: torch.nn.Module) -> torch.device:
    for t in module.parameters():
        return t.device
    return torch.device("cpu")


def _to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}


# ---------------------------------------------------------------------------------------------
# the reference side (runs in the test process)
# ---------------------------------------------------------------------------------------------
def train_reference(
    model_name: str,
    num_replicas: int,
    steps: int,
    batch_size: int,
    optimizer: str = "adamw",
    optimizer_kwargs: dict[str, Any] | None = None,
    module_dtype: torch.dtype | None = None,
    return_optimizer: bool = False,
    nmicros: int | None = None,
    shapes: list[tuple[int, int | None]] | None = None,
) -> Any:
    """Train the single-device model on all replicas' batches at once; return losses and model (and,
    with `return_optimizer`, the optimizer). `module_dtype`: cast the model first, as parallelize does.
    `nmicros`: gradient accumulation over that many micro-batches per step (one loss each)."""
    model, make_batch = zoo.build(model_name, seed=SEED)
    if module_dtype is not None:
        model = model.to(module_dtype)
    opt_cls, opt_kwargs = _make_optimizer(optimizer, optimizer_kwargs or {})
    opt = opt_cls([p for p in model.parameters() if p.requires_grad], **opt_kwargs)
    losses = []
    for step in range(steps):
        for m in range(nmicros or 1):
            seeds = [_batch_seed(step, k, m if nmicros else None) for k in range(num_replicas)]
            batch = _cat_batches([_step_batch(make_batch, seed, batch_size, step, shapes) for seed in seeds])
            loss = zoo.extract_loss(model(**batch))
            loss.backward()  # micro-batch gradients add up
            losses.append(loss.detach().float().item())
        opt.step()
        opt.zero_grad()
    return (losses, model, opt) if return_optimizer else (losses, model)


def compare(
    results: list[dict[str, Any]],
    ref_losses: list[float],
    ref_model: torch.nn.Module,
    *,
    rtol: float,
    atol: float,
    label: str = "",
    param_atol: float | None = None,
) -> None:
    """Assert the parallel run matches the reference; messages name the step, rank or parameter."""
    steps = len(ref_losses)
    by_replica: dict[int, list[dict[str, Any]]] = {}
    for r in results:
        by_replica.setdefault(r["replica"], []).append(r)

    # 1. every rank of a replica saw the same loss
    for replica, rs in sorted(by_replica.items()):
        first = rs[0]
        for other in rs[1:]:
            torch.testing.assert_close(
                torch.tensor(other["losses"], dtype=torch.float64),
                torch.tensor(first["losses"], dtype=torch.float64),
                rtol=rtol,
                atol=atol,
                msg=lambda m, a=first, b=other, k=replica: (
                    f"{label}: ranks {a['rank']} and {b['rank']} of replica {k} report different losses "
                    f"{a['losses']} vs {b['losses']}\n{m}"
                ),
            )

    # 2. mean of the replicas' losses == reference loss, step by step
    par = [sum(rs[0]["losses"][s] for rs in by_replica.values()) / len(by_replica) for s in range(steps)]
    for s in range(steps):
        torch.testing.assert_close(
            torch.tensor(par[s], dtype=torch.float64),
            torch.tensor(ref_losses[s], dtype=torch.float64),
            rtol=rtol,
            atol=atol,
            msg=lambda m, s=s: (
                f"{label}: loss differs at step {s}: parallel (mean over replicas) {par[s]!r} vs "
                f"single-device {ref_losses[s]!r}\nall steps: parallel {par}, single-device {ref_losses}\n{m}"
            ),
        )

    # 3. merged parameters == reference parameters, by original name
    merged = next(r["merged"] for r in results if r["rank"] == 0)
    assert isinstance(merged, dict), (
        f"{label}: merge_state_dicts returned {type(merged).__name__}, not a dict"
    )
    ref_state = ref_model.state_dict()
    expected = dict(ref_model.named_parameters())
    missing = [name for name in expected if name not in merged]
    assert not missing, (
        f"{label}: merged state dict lacks parameters {missing}; it has {sorted(k for k in merged)}"
    )
    # tied aliases (e.g. lm_head.weight) and buffers are checked too when the merge provides them
    names = list(expected) + [
        n for n in ref_state if n not in expected and isinstance(merged.get(n), torch.Tensor)
    ]
    mismatched = []
    for name in names:
        got, want = merged[name], ref_state[name]
        if not isinstance(got, torch.Tensor) or got.shape != want.shape:
            mismatched.append(f"{name}: got {_describe(got)}, expected a tensor of shape {tuple(want.shape)}")
            continue
        try:
            torch.testing.assert_close(
                got.to(want.dtype), want.detach(), rtol=rtol, atol=atol if param_atol is None else param_atol
            )
        except AssertionError as e:
            mismatched.append(f"{name}: {e}")
    assert not mismatched, (
        f"{label}: {len(mismatched)} of {len(names)} parameters differ from the single-device model "
        f"after {steps} steps:\n" + "\n".join(mismatched)
    )


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


# ---------------------------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------------------------
def run_parity(
    model_name: str,
    policy: Any,
    plan_ngpus: int,
    runtime_ngpus: int,
    steps: int = 3,
    *,
    tmp_path: str | os.PathLike,
    rtol: float = 1e-5,
    atol: float = 1e-5,  # Adam turns ~1e-10 gradient noise on zero-gradient params (key biases) into ~1e-6
    batch_size: int = 4,
    optimizer: str = "adamw",
    optimizer_kwargs: dict[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    config_kwargs: dict[str, Any] | None = None,
    module_dtype: torch.dtype | None = None,
    nmicros: int | None = None,
    shapes: list[tuple[int, int | None]] | None = None,
) -> list[dict[str, Any]]:
    """Train `model_name` under `policy` with ComputeConfig(plan_ngpus, runtime_ngpus) for `steps`
    optimizer steps and assert it matches single-device training. Returns the per-rank results.

    `optimizer` names an entry of OPTIMIZERS; `atol` defaults to that entry's (1e-5 for AdamW,
    1e-6 for SGD); `rtol` 1e-5. Losses and parameters are compared with the same tolerances.
    `module_dtype` (e.g. torch.bfloat16) casts both models before training (parallelize's argument).
    `nmicros`: end-to-end mode (pass use_end2end=True in config_kwargs): each step is one
    `train_step` over `nmicros` micro-batches, against single-device gradient accumulation over them.
    `shapes`: one (batch size, sequence length or None) per step, other than the traced
    (`batch_size`, full length): the module is compiled once and called with each (steps = len(shapes)).
    """
    if shapes is not None:
        steps = len(shapes)
    if atol is None:
        atol = OPTIMIZERS[optimizer][2]
    if runtime_ngpus % plan_ngpus != 0:
        raise ValueError(f"runtime_ngpus ({runtime_ngpus}) must be a multiple of plan_ngpus ({plan_ngpus})")
    gen_savedir = str(Path(tmp_path) / "gen")
    results = spawn(
        train_parallel,
        runtime_ngpus,
        tmp_path,
        model_name,
        policy,
        plan_ngpus,
        steps,
        batch_size,
        gen_savedir,
        optimizer,
        optimizer_kwargs,
        config_kwargs,
        module_dtype,
        False,
        nmicros,
        shapes,
        timeout=timeout,
    )
    ref_losses, ref_model = train_reference(
        model_name,
        runtime_ngpus // plan_ngpus,
        steps,
        batch_size,
        optimizer,
        optimizer_kwargs,
        module_dtype,
        nmicros=nmicros,
        shapes=shapes,
    )
    policy_name = policy if isinstance(policy, str) else getattr(policy, "__name__", repr(policy))
    extra = "".join(f", {k}={v!r}" for k, v in (config_kwargs or {}).items())
    label = f"{model_name} / {policy_name} / ComputeConfig({plan_ngpus}, {runtime_ngpus}{extra})"
    param_atol = max(atol, ADAMW_PARAM_ATOL) if optimizer == "adamw" else atol
    compare(results, ref_losses, ref_model, rtol=rtol, atol=atol, label=label, param_atol=param_atol)
    return results


@dataclass(frozen=True)
class ParityCase:
    """One parity run of `run_parity_many`: a zoo model under `policy` on `plan_ngpus` devices."""

    model_name: str
    policy: Any
    plan_ngpus: int
    config_kwargs: dict[str, Any] = field(default_factory=dict)
    nmicros: int | None = None
    optimizer: str = "adamw"
    """An entry of OPTIMIZERS; its tolerance applies (AdamW's parameter tolerance is ADAMW_PARAM_ATOL)."""
    optimizer_kwargs: dict[str, Any] = field(default_factory=dict)
    module_dtype: torch.dtype | None = None
    """Cast both models to it before training (parallelize's `module_dtype`)."""

    @property
    def label(self) -> str:
        extra = f" {self.optimizer}" if self.optimizer != "adamw" else ""
        extra += f" {self.module_dtype}" if self.module_dtype is not None else ""
        return f"{self.model_name} / {self.policy} / plan_ngpus={self.plan_ngpus} {self.config_kwargs}{extra}"


def _train_cases(rank: int, world_size: int, cases: list[ParityCase], steps: int, root: str) -> list:
    """Every case's `train_parallel` in turn, in one process per rank (one start-up for them all)."""
    out = []
    for k, case in enumerate(cases):
        try:
            out.append(
                train_parallel(
                    rank,
                    world_size,
                    case.model_name,
                    case.policy,
                    case.plan_ngpus,
                    steps,
                    4,
                    f"{root}/case{k}",
                    optimizer=case.optimizer,
                    optimizer_kwargs=case.optimizer_kwargs,
                    config_kwargs=case.config_kwargs,
                    module_dtype=case.module_dtype,
                    nmicros=case.nmicros,
                )
            )
        except Exception as exc:
            raise RuntimeError(f"parity case {case.label} failed on rank {rank}: {exc}") from exc
    return out


def run_parity_many(
    cases: list[ParityCase],
    runtime_ngpus: int,
    *,
    tmp_path: str | os.PathLike,
    steps: int = 2,
    timeout: float = DEFAULT_TIMEOUT,
) -> list[list[dict[str, Any]]]:
    """`run_parity` for several cases on the same `runtime_ngpus` processes, started once (batch 4,
    each case's optimizer, AdamW by default, with its default tolerances). Every case is compared;
    the assertion lists each one that differs. Returns the per-rank results of each case, in order."""
    root = Path(tmp_path) / "gen"
    per_rank = spawn(_train_cases, runtime_ngpus, tmp_path, cases, steps, str(root), timeout=timeout)
    failures, results = [], []
    for k, case in enumerate(cases):
        case_results = [r[k] for r in per_rank]
        results.append(case_results)
        ref_losses, ref_model = train_reference(
            case.model_name,
            runtime_ngpus // case.plan_ngpus,
            steps,
            4,
            case.optimizer,
            case.optimizer_kwargs,
            case.module_dtype,
            nmicros=case.nmicros,
        )
        atol = OPTIMIZERS[case.optimizer][2]
        try:
            compare(
                case_results,
                ref_losses,
                ref_model,
                rtol=1e-5,
                atol=atol,
                label=case.label,
                param_atol=max(atol, ADAMW_PARAM_ATOL) if case.optimizer == "adamw" else atol,
            )
        except AssertionError as exc:
            failures.append(str(exc))
    assert not failures, f"{len(failures)} of {len(cases)} cases differ:\n" + "\n\n".join(failures)
    return results
