"""ZeRO stage 1: an optimizer that keeps state only for this rank's slice of the parameters.

`build_optimizer` returns a `ZeroOptimizer` when a ParallelModule runs with `use_zero`. It wraps the
user's optimizer, built over `ZeroPiece.param`s: for each parameter, the part that falls in this
rank's slice of its gradient bucket (a 1-D view of the flat parameter buffer). A step syncs the
gradients, points each piece's `.grad` at its reduced slice, steps the wrapped optimizer, and
all-gathers the parameters within the ZeRO group. Per-element optimizers (SGD, Adam, AdamW, ...)
give the same result as on whole parameters. A mixed-precision optimizer (`MixedPrecisionAdamW`, ...)
keeps fp32 masters of the slices only; where the gradient buckets are wider than the parameters
(`reduce_grads_in_fp32`) a piece's reduced gradient is its `.main_grad`, not its `.grad`.

State dicts are indexed like a plain optimizer's over the trainable parameters (the order
`build_optimizer` uses: `parameters_for_optimizer()`; frozen parameters have no state) and list `param_names`; a ZeRO state dict adds `zero_slices`: for each parameter `[start, end]`,
the elements of the flattened local parameter its states cover on this rank (`None`: the whole
parameter, not sharded). `merge_state_dicts` joins the slices of a ZeRO group back together.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from nnscaler.runtime.checkpoint.formats import OPTIMIZER_META_KEY, ZERO_SLICES_KEY, is_parallel_module
from nnscaler.runtime.checkpoint.piece_meta import optimizer_meta
from nnscaler.runtime.grads.reducer import ZeroPiece

__all__ = ["ZeroOptimizer", "ZERO_SLICES_KEY"]

"""Param-group key of a ZeRO optimizer state dict: `[start, end]` (or None) per parameter."""

_GROUP_KEYS = ("params", "param_names", ZERO_SLICES_KEY)


def _per_element(value: Any, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


def _delegate(name: str) -> property:
    """An attribute of the wrapped optimizer (kept on the wrapper until the wrapped one exists)."""

    def get(self: ZeroOptimizer) -> Any:
        inner = self.__dict__.get("inner")
        return getattr(inner, name) if inner is not None else self.__dict__[f"_own_{name}"]

    def set_(self: ZeroOptimizer, value: Any) -> None:
        inner = self.__dict__.get("inner")
        if inner is not None:
            setattr(inner, name, value)
        else:
            self.__dict__[f"_own_{name}"] = value

    return property(get, set_)


class ZeroOptimizer(torch.optim.Optimizer):
    """`optimizer_fn(pieces, **kwargs)` over this rank's ZeRO slices, used like the plain optimizer.

    `param_groups`, `state` and `defaults` are the wrapped optimizer's (so LR schedulers work);
    `step`, `zero_grad`, `state_dict`, `load_state_dict` and `clip_gnorm` act on the whole module.
    """

    param_groups = _delegate("param_groups")
    state = _delegate("state")
    defaults = _delegate("defaults")

    def __init__(
        self,
        module: nn.Module,
        params: list[nn.Parameter],
        optimizer_fn: Callable[..., torch.optim.Optimizer],
        sync: Callable[[], None],
        clip: Callable[[float | None], float],
        names: Callable[[], dict[int, str]],
        **kwargs: Any,
    ) -> None:
        self.__dict__["inner"] = None
        self.module = module
        self.params = params
        """The module's parameters, in the order state dicts index them."""
        self._sync, self._clip, self._names = sync, clip, names
        self._pms = [m for m in module.modules() if is_parallel_module(m)]
        pieces: dict[int, ZeroPiece] = {}
        sharded: set[int] = set()
        for pm in self._pms:
            red = pm.reducer
            if red is not None and red.zero:
                pieces.update((id(z.source), z) for z in red.pieces)
                sharded.update(id(p) for p in red.params)
        self._entries: list[tuple[int, nn.Parameter, tuple[int, int] | None]] = []
        """`(index in params, what the wrapped optimizer updates, its [start, end) or None)`."""
        self._slices: list[list[int] | None] = []
        for j, p in enumerate(params):
            if id(p) not in sharded:
                self._entries.append((j, p, None))
                self._slices.append(None)
            elif id(p) in pieces:
                z = pieces[id(p)]
                self._entries.append((j, z.param, (z.start, z.end)))
                self._slices.append([z.start, z.end])
            else:
                self._slices.append([0, 0])  # nothing of it in this rank's slice
        self._pieces = [pieces[id(p)] for p in params if id(p) in pieces]
        opt_params = [q for _, q, _ in self._entries]
        if not opt_params:  # this rank's slice holds only padding: the optimizer still needs a tensor
            opt_params = [nn.Parameter(torch.zeros(0, device=params[0].device if params else None))]
        inner = optimizer_fn(opt_params, **kwargs)
        if len(inner.param_groups) != 1:
            raise NotImplementedError("ZeRO: the optimizer must have exactly one param group")
        super().__init__(opt_params, dict(inner.defaults))
        for key in ("param_groups", "state", "defaults"):
            self.__dict__.pop(f"_own_{key}", None)
        self.__dict__["inner"] = inner
        watch = getattr(inner, "watch_versions", None)
        if watch is not None:  # a parameter loaded in place (not the piece) must refresh the fp32 master
            for z in self._pieces:
                watch(z.param, z.source)

    # ---- training ------------------------------------------------------------------------------------

    def _attach_grads(self) -> None:
        for z in self._pieces:
            grad = z.grad()
            if grad.dtype == z.param.dtype:
                z.param.grad = grad
            else:  # fp32 buckets of bf16 / fp16 parameters: the optimizer reads .main_grad
                z.param.grad, z.param.main_grad = None, grad  # type: ignore[attr-defined]

    def step(self, closure: Callable[[], float] | None = None) -> Any:  # type: ignore[override]
        """Sync gradients, step the wrapped optimizer on this rank's slice, all-gather the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for pm in self._pms:
            if pm.reducer is not None:
                pm.reducer.check()
        self._sync()
        self._attach_grads()
        self.inner.step()
        if not getattr(self.inner, "step_skipped", False):  # a skipped (inf / nan) step changed nothing
            for pm in self._pms:
                pm.gather_params()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for pm in self._pms:
            pm.zero_grad(set_to_none)
        for p in self.params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.detach_().zero_()
        self.inner.zero_grad(set_to_none)

    def clip_gnorm(self, max_norm: float | None = None) -> torch.Tensor:
        """Total gradient 2-norm of the module (each piece counted once; 0-dim device tensor, no host
        sync); clip in place if asked."""
        return self._clip(max_norm)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if self.__dict__.get("inner") is None:  # the base class's constructor
            super().add_param_group(param_group)
            return
        raise NotImplementedError("ZeRO: parameter groups cannot be added to the optimizer")

    # ---- state dicts ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The wrapped optimizer's state, indexed by position in `params`, with `param_names` and
        `zero_slices` in the (single) param group."""
        inner = self.inner.state_dict()
        state = {j: inner["state"][k] for k, (j, _, _) in enumerate(self._entries) if k in inner["state"]}
        names = self._names()
        group = {k: v for k, v in inner["param_groups"][0].items() if k != "params"}
        group["params"] = list(range(len(self.params)))
        group["param_names"] = [names.get(id(p), f"<unnamed {i}>") for i, p in enumerate(self.params)]
        group[ZERO_SLICES_KEY] = [None if s is None else list(s) for s in self._slices]
        return {"state": state, "param_groups": [group], OPTIMIZER_META_KEY: optimizer_meta(self.module)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load a state dict of this rank (from `state_dict`), or one indexed by `params` whose
        states are whole local tensors (a plain optimizer's, or `load_merged_state_dict`'s)."""
        groups = state_dict["param_groups"]
        if len(groups) != 1 or len(groups[0]["params"]) != len(self.params):
            raise ValueError(
                f"ZeRO optimizer: the state dict has {len(groups)} param groups with "
                f"{[len(g['params']) for g in groups]} parameters; expected one group of {len(self.params)}"
            )
        saved_slices = groups[0].get(ZERO_SLICES_KEY)
        by_index = dict(zip(groups[0]["params"], range(len(self.params))))
        saved_state = {by_index[int(i)]: s for i, s in state_dict["state"].items()}
        inner_state: dict[int, dict[str, Any]] = {}
        for k, (j, _, piece) in enumerate(self._entries):
            if j not in saved_state:
                continue
            state, saved = saved_state[j], saved_slices[j] if saved_slices is not None else None
            if piece is None or saved is not None:
                if saved is not None and list(saved) != list(piece or []):
                    raise ValueError(
                        f"ZeRO optimizer: parameter {j} was saved as slice {saved}, this rank holds "
                        f"{list(piece or [])}; merge the ranks' state dicts (merge_state_dicts) and load "
                        "them with load_merged_state_dict"
                    )
                inner_state[k] = state
                continue
            start, end = piece
            numel = self.params[j].numel()
            inner_state[k] = {
                key: v.reshape(-1)[start:end].clone() if _per_element(v, numel) else v
                for key, v in state.items()
            }
        group = {k: v for k, v in groups[0].items() if k not in _GROUP_KEYS}
        group["params"] = list(range(len(self.inner.param_groups[0]["params"])))
        self.inner.load_state_dict({"state": inner_state, "param_groups": [group]})
