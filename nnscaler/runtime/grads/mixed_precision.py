"""Mixed precision: Adam / AdamW over bf16 or fp16 parameters with fp32 master weights, and dynamic
loss scaling for fp16.

    opt = build_optimizer(pm, MixedPrecisionAdamW, lr=1e-3)             # bf16 parameters
    loss.backward(); opt.clip_gnorm(1.0); opt.step(); opt.zero_grad()

    scaler = DynamicLossScaler()                                         # fp16 parameters
    opt = build_optimizer(pm, MixedPrecisionAdamW, lr=1e-3, loss_scaler=scaler)
    scaler.scale(loss).backward(); opt.step(); opt.zero_grad()
    # or without loss_scaler=...: scaler.step(opt); scaler.update() in place of opt.step()

`MixedPrecisionAdam` / `MixedPrecisionAdamW` (nnScaler's names) are torch's Adam / AdamW over fp32
copies ("masters") of the bf16 / fp16 parameters they are given, so their state (`exp_avg`,
`exp_avg_sq`) is fp32 too; fp32 parameters are their own masters. A step
1. takes each parameter's gradient: `param.main_grad` where the reducer keeps reduced gradients in
   fp32 (`ComputeConfig.reduce_grads_in_fp32`), else `param.grad`;
2. with a loss scaler: looks for inf / nan in them; the verdict is all-reduced over the whole world,
   so every rank skips the step together, and the scaler backs off (or grows after
   `growth_interval` good steps);
3. casts the gradients to fp32 (a chunk of parameters at a time, so at most `MASTER_GRAD_CHUNK_NUMEL`
   fp32 gradients exist at once, into one reused buffer with one `_foreach_copy_` per chunk),
   multiplies them by 1 / loss scale times the clip coefficient from `clip_gnorm` (one `_foreach_mul_`;
   deferred, so nothing is scaled in bf16), steps Adam on the chunk's masters (the base step sees only
   them: no re-scan of every parameter per chunk), and copies the masters back into the parameters
   (rounding to their dtype).

Under ZeRO (`use_zero`) `build_optimizer` wraps the optimizer in a `ZeroOptimizer`, which builds it
over this rank's slices of the parameters: the masters then cover only those slices, like the state.

A parameter changed in place outside the optimizer (e.g. loading weights) is noticed by its version
counter: its master is taken from the parameter again before the next step.

State dicts are the base optimizer's plus, per parameter, the fp32 master under `MASTER_KEY`
("fp32_params", as nnScaler): a per-element state, so `merge_state_dicts` joins ZeRO slices and tensor-
parallel shards of it like `exp_avg`, and `merged["state"][i]["fp32_params"]` is the full fp32 weight
of parameter i, from which a single-device optimizer (and model) can be rebuilt. Loading takes the
masters from there (from the parameters where a state lacks it). The loss scaler keeps its own state
(`DynamicLossScaler.state_dict`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from nnscaler.runtime.grads.grad_ops import param_grad
from nnscaler.runtime.grads.loss_scaler import DynamicLossScaler, any_nonfinite

__all__ = [
    "MixedPrecisionOptimizer",
    "MixedPrecisionAdam",
    "MixedPrecisionAdamW",
    "DynamicLossScaler",
    "find_mixed_precision",
    "MASTER_KEY",
    "MASTER_GRAD_CHUNK_NUMEL",
]

MASTER_KEY = "fp32_params"
"""Optimizer state key of the fp32 master weight of a parameter (nnScaler's name)."""
MASTER_GRAD_CHUNK_NUMEL = 1 << 24
"""At most this many gradient elements are cast to fp32 at once during a step (64 MB), besides the
largest parameter."""

_LOW_PRECISION = (torch.float16, torch.bfloat16)


class MixedPrecisionOptimizer:
    """Mixin over a torch optimizer: it optimizes fp32 masters of the low-precision parameters given.

    `param_groups` hold the masters (LR schedulers work as usual); `model_param_groups()` the
    parameters given. `loss_scaler`: a `DynamicLossScaler` (fp16), or None.
    """

    takes_loss_scaler = True
    """loss_scaler.LossScaledOptimizer: how DynamicLossScaler recognises one without importing this module."""
    reads_main_grad = True
    """Reads `param.main_grad` (fp32 reduced gradients) where present (ComputeConfig.reduce_grads_in_fp32)."""

    def __init__(self, params: Any, *args: Any, loss_scaler: DynamicLossScaler | None = None, **kwargs: Any):
        self.loss_scaler = loss_scaler
        self._model_of: dict[int, torch.Tensor] = {}
        """id(master) -> the parameter it is the master of (itself for fp32 parameters)."""
        self._master_of: dict[int, torch.Tensor] = {}
        self._watched: dict[int, torch.Tensor] = {}
        """id(master) -> the tensor whose version counter tells that the parameter changed elsewhere."""
        self._versions: dict[int, int] = {}
        self._grad_factor: float | torch.Tensor = 1.0
        self.step_skipped = False
        """Whether the last step was skipped for inf / nan gradients."""
        super().__init__(params, *args, **kwargs)  # type: ignore[call-arg]
        self._record_versions()

    # ---- masters ---------------------------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        masters = []
        for p in params:
            master = self._master_of.get(id(p))
            if master is None:
                if p.dtype in _LOW_PRECISION:
                    master = nn.Parameter(p.detach().float(), requires_grad=p.requires_grad)
                else:
                    master = p
                self._master_of[id(p)] = master
                self._model_of[id(master)] = p
                self._watched[id(master)] = p
            masters.append(master)
        super().add_param_group({**param_group, "params": masters})  # type: ignore[misc]

    def _pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(parameter, master) of every parameter, in state-dict order."""
        groups: list[dict[str, Any]] = self.param_groups  # type: ignore[attr-defined]
        return [(self._model_of[id(m)], m) for g in groups for m in g["params"]]

    def model_param_groups(self) -> list[list[torch.Tensor]]:
        """The parameters given (not the masters), group by group."""
        groups: list[dict[str, Any]] = self.param_groups  # type: ignore[attr-defined]
        return [[self._model_of[id(m)] for m in g["params"]] for g in groups]

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 masters, in state-dict order."""
        return [m for _, m in self._pairs()]

    def watch_versions(self, param: torch.Tensor, source: torch.Tensor) -> None:
        """Refresh `param`'s master when `source` (e.g. the module parameter that `param` is a slice of)
        is changed in place, instead of when `param` is."""
        master = self._master_of[id(param)]
        self._watched[id(master)] = source
        self._versions[id(master)] = source._version

    def _record_versions(self) -> None:
        self._versions = {key: t._version for key, t in self._watched.items()}

    @torch.no_grad()
    def _refresh_changed(self) -> None:
        for p, m in self._pairs():
            if m is not p and self._watched[id(m)]._version != self._versions.get(id(m)):
                m.copy_(p)

    # ---- gradients -------------------------------------------------------------------------------------

    @property
    def grad_multiplier(self) -> float | torch.Tensor:
        """What the step multiplies the gradients by: 1 / loss scale times the pending clip coefficient."""
        scale = self.loss_scaler.get_scale() if self.loss_scaler is not None else 1.0
        return self._grad_factor / scale

    def multiply_grads(self, factor: float | torch.Tensor) -> None:
        """Multiply the gradients of the next step by `factor` (applied in fp32, when they are cast);
        a tensor factor (a clip coefficient) stays on device, so no host sync."""
        if isinstance(factor, torch.Tensor):
            self._grad_factor = factor.detach().float() * self._grad_factor
        else:
            self._grad_factor = self._grad_factor * float(factor)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients of the parameters (`.grad` and `.main_grad`) and of the masters."""
        for p, m in self._pairs():
            for owner in (p, m) if m is not p else (p,):
                for attr in ("grad", "main_grad"):
                    g = getattr(owner, attr, None)
                    if g is None:
                        continue
                    if set_to_none:
                        setattr(owner, attr, None)
                    else:
                        g.detach().zero_()  # in place (bucket views stay views)
        self._grad_factor = 1.0

    # ---- step ------------------------------------------------------------------------------------------

    def _base_step(self) -> Callable[..., Any]:
        """The base optimizer's step without the hook wrapper torch puts on it (the hooks ran already)."""
        fn = super().step  # type: ignore[misc]
        fn = getattr(fn, "__func__", fn)
        while getattr(fn, "hooked", False):
            fn = fn.__wrapped__
        return fn

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Step the masters from the (cast, unscaled, clipped) gradients; copy them into the parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        pairs = self._pairs()
        self._refresh_changed()
        grads = [param_grad(p) if p.requires_grad else None for p, _ in pairs]
        factor = self.grad_multiplier
        self._grad_factor = 1.0
        self.step_skipped = False
        if self.loss_scaler is not None:
            found = any_nonfinite(g for g in grads if g is not None)
            self.loss_scaler._observe(found)
            if found:
                self.step_skipped = True
                return loss
        todo = [(p, m, g) for (p, m), g in zip(pairs, grads) if g is not None]
        own = [(m, m.grad) for _, m in pairs if m.grad is not None]  # fp32 parameters' own .grad
        for m, _ in own:
            m.grad = None  # so that each chunk's step updates that chunk only
        base = self._base_step()
        chunks = _chunks(todo, MASTER_GRAD_CHUNK_NUMEL)
        staging = _Staging(max((_low_numel(c) for c in chunks), default=0), todo)
        try:
            for chunk in chunks:
                with torch.no_grad():
                    g32 = staging.fp32_grads(chunk)
                    _scale_all(g32, factor)  # in place on fp32 .grad / .main_grad: consumed here
                    for (_, m, _), g in zip(chunk, g32):
                        m.grad = g
                with self._only([m for _, m, _ in chunk]):  # the base step scans this chunk only
                    base(self)
                with torch.no_grad():
                    low = [(p, m) for p, m, _ in chunk if m is not p]
                    if low:
                        torch._foreach_copy_([p.data for p, _ in low], [m.detach() for _, m in low])
                    for _, m, _ in chunk:
                        m.grad = None
        finally:
            for m, g in own:
                m.grad = g
        self._record_versions()
        return loss

    @contextlib.contextmanager
    def _only(self, masters: list[torch.Tensor]) -> Iterator[None]:
        """Inside: the param groups list only `masters` (in their order), so one base step per chunk
        scans that chunk, not every parameter again."""
        wanted = {id(m) for m in masters}
        groups: list[dict[str, Any]] = self.param_groups  # type: ignore[attr-defined]
        saved = [g["params"] for g in groups]
        for g in groups:
            g["params"] = [m for m in g["params"] if id(m) in wanted]
        try:
            yield
        finally:
            for g, params in zip(groups, saved):
                g["params"] = params

    # ---- state dicts -----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The base optimizer's state dict; each parameter's state also holds its fp32 master (MASTER_KEY)."""
        sd = super().state_dict()  # type: ignore[misc]
        state = dict(sd["state"])
        for i, m in enumerate(self.master_params()):
            state[i] = {**state.get(i, {}), MASTER_KEY: m.detach()}
        sd["state"] = dict(sorted(state.items()))
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict; masters come from its `MASTER_KEY` entries, else from the parameters."""
        pairs = self._pairs()
        state: dict[Any, Any] = {}
        saved: dict[int, torch.Tensor] = {}
        for key, value in state_dict["state"].items():
            value = dict(value)
            master = value.pop(MASTER_KEY, None)
            if master is not None:
                saved[int(key)] = master
            if value:
                state[key] = value
        for i, master in saved.items():
            if i >= len(pairs) or tuple(master.shape) != tuple(pairs[i][1].shape):
                want = tuple(pairs[i][1].shape) if i < len(pairs) else "no parameter"
                raise ValueError(
                    f"{type(self).__name__}.load_state_dict: {MASTER_KEY} of parameter {i} has shape "
                    f"{tuple(master.shape)}, expected {want}"
                )
        super().load_state_dict({**state_dict, "state": state})  # type: ignore[misc]
        with torch.no_grad():
            for i, (p, m) in enumerate(pairs):
                if i in saved:
                    m.copy_(saved[i])
                    if m is not p:
                        p.copy_(m)
                elif m is not p:
                    m.copy_(p)
        self._record_versions()


def _low_numel(chunk: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> int:
    """Elements of the chunk's gradients that must be cast to fp32 (their dtype is not their master's)."""
    return sum(g.numel() for _, m, g in chunk if g.dtype != m.dtype)


class _Staging:
    """One fp32 buffer per device, reused by every chunk of a step, that low-precision gradients are
    cast into with one `_foreach_copy_` per chunk (fp32 gradients are used as they are)."""

    def __init__(self, numel: int, todo: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
        devices = {g.device for _, m, g in todo if g.dtype != m.dtype}
        self.buffers = {d: torch.empty(numel, dtype=torch.float32, device=d) for d in devices}

    def fp32_grads(self, chunk: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        used = dict.fromkeys(self.buffers, 0)
        casts: list[tuple[torch.Tensor, torch.Tensor]] = []
        for _, m, g in chunk:
            g = g.detach()
            if g.dtype == m.dtype:
                out.append(g)
                continue
            o = used[g.device]
            view = self.buffers[g.device][o : o + g.numel()].view(g.shape)
            used[g.device] = o + g.numel()
            casts.append((view, g))
            out.append(view)
        if casts:
            torch._foreach_copy_([v for v, _ in casts], [g for _, g in casts])
        return out


def _scale_all(grads: list[torch.Tensor], factor: float | torch.Tensor) -> None:
    """Multiply `grads` in place by `factor` (a device tensor stays on device: no host sync)."""
    if not grads or (not isinstance(factor, torch.Tensor) and factor == 1.0):
        return
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for device, gs in by_device.items():
        torch._foreach_mul_(gs, factor.to(device) if isinstance(factor, torch.Tensor) else factor)


def _chunks(
    items: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], numel: int
) -> list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]]:
    chunks: list[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = []
    size = 0
    for item in items:
        n = item[1].numel()
        if not chunks or (size + n > numel and chunks[-1]):
            chunks.append([])
            size = 0
        chunks[-1].append(item)
        size += n
    return chunks


class MixedPrecisionAdam(MixedPrecisionOptimizer, torch.optim.Adam):
    """`torch.optim.Adam` with fp32 master weights and state for bf16 / fp16 parameters (module docs)."""


class MixedPrecisionAdamW(MixedPrecisionOptimizer, torch.optim.AdamW):
    """`torch.optim.AdamW` with fp32 master weights and state for bf16 / fp16 parameters (module docs)."""


def find_mixed_precision(optimizer: Any) -> MixedPrecisionOptimizer | None:
    """`optimizer` if it is a mixed-precision one, or the one a ZeroOptimizer wraps; else None."""
    for opt in (optimizer, getattr(optimizer, "inner", None)):
        if isinstance(opt, MixedPrecisionOptimizer):
            return opt
    return None
