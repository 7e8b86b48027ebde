"""ParallelModule: the base class of generated per-rank code.

A generated subclass registers this rank's piece of every parameter and buffer with `add_shard`
(local name, original state-dict name, full shape, which shard), then calls `load_shards`. Its
`state_dict()` is keyed by the ORIGINAL names, holds this rank's local tensors, and carries the
sharding metadata as extra state, so `merge_state_dicts` can rebuild the single-device state dict.

Gradients are averaged over the data-parallel replicas by a `Reducer` (nnscaler.runtime.grads.reducer),
built on the first forward with gradients enabled (or the first `sync_grad` / `build_optimizer`) from
`compute_config`, which the compiler sets after construction. Under ZeRO stage 3 it is a
`Zero3Reducer` (nnscaler.runtime.grads.zero3): the registered parameters then hold no data, and
`__getattr__` hands the generated forward gathered ones.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nnscaler.config import ComputeConfig
from nnscaler.mesh import ParallelDims
from nnscaler.runtime.checkpoint.files import load_file
from nnscaler.runtime.checkpoint.formats import EXTRA_STATE_FORMAT, EXTRA_STATE_KEY
from nnscaler.runtime.device import is_initialized, runtime_device
from nnscaler.runtime.dist import lifecycle, preflight
from nnscaler.runtime.dist.groups import create_groups, create_host_groups, get_group, get_host_group
from nnscaler.runtime.grads.reducer import Reducer
from nnscaler.runtime.grads.zero3 import Zero3Reducer
from nnscaler.runtime.module_parts import shapes
from nnscaler.runtime.module_parts.buffers_init import BuffersInitMixin
from nnscaler.runtime.module_parts.compat import ModuleCompatMixin
from nnscaler.runtime.module_parts.compiled import compile_generated
from nnscaler.runtime.module_parts.constants import load_constants
from nnscaler.runtime.module_parts.copies import CopiesMixin
from nnscaler.runtime.module_parts.end2end import EndToEndMixin
from nnscaler.runtime.module_parts.grads import GradientsMixin
from nnscaler.runtime.shard import Shard, local_shape, normalize_shard, shard_slice

__all__ = ["ParallelModule", "ShardInfo", "EXTRA_STATE_FORMAT", "EXTRA_STATE_KEY"]

_logger = logging.getLogger(__name__)  # ParallelModule's warnings (module_parts/buffers_init.py logs here)


@dataclass(frozen=True)
class ShardInfo:
    """Where a local tensor comes from: its original name, full shape and which shard this rank holds."""

    local_name: str
    original_name: str
    full_shape: tuple[int, ...]
    dtype: torch.dtype
    shard: Shard | None
    is_param: bool
    persistent: bool

    @property
    def local_shape(self) -> tuple[int, ...]:
        return local_shape(self.full_shape, self.shard)

    def to_meta(self) -> dict[str, Any]:
        """Plain-data form stored in checkpoints (loads with `torch.load(weights_only=True)`)."""
        return {
            "local_name": self.local_name,
            "full_shape": list(self.full_shape),
            "shard": None if self.shard is None else list(self.shard),
            "dtype": str(self.dtype).removeprefix("torch."),
            "is_param": self.is_param,
            "persistent": self.persistent,
        }


def _before_forward(module: ParallelModule, args: Any, kwargs: dict[str, Any]) -> None:
    if not module._in_step and not module.use_scheduler:  # train_step checked already; stages refuse
        module._preflight("forward", lambda: preflight.named_call_inputs(module.forward, args, kwargs))
    module._grads_synced = False
    if torch.is_grad_enabled():
        if module._step_started is None:
            module._step_started = time.perf_counter()  # bucket autotuning times forward to sync_grad
        module._ensure_reducer()  # before backward, so its hooks overlap communication with it
    if module._zero3 is not None:
        module._zero3.begin_forward()


def _after_forward(module: ParallelModule, args: Any, output: Any) -> None:
    if module._zero3 is not None:
        module._zero3.end_forward()  # ZeRO-3: drop the gathered parameters


class ParallelModule(
    GradientsMixin, ModuleCompatMixin, EndToEndMixin, BuffersInitMixin, CopiesMixin, nn.Module
):
    """Base class of generated code: one rank's shards of a model, plus gradient sync and checkpoints."""

    _nnscaler_parallel_module = True
    """checkpoint.formats.PARALLEL_MODULE_FLAG: how code below this module recognises one."""
    rank: int = 0
    compute_config: ComputeConfig | None = None
    """Set by the compiler on the generated class; may be None."""
    init_state_dict: Mapping[str, torch.Tensor] | None = None
    """Full (single-device) weights to take shards from in `load_shards(True)`, keyed by original name."""
    init_weights_file: str | None = None
    """Or: a `torch.save`d full state dict (path relative to the generated file); read with mmap."""
    inference_only: bool = False
    """Generated with ComputeConfig(inference_only=True): forward only; parameters do not require
    gradients, no gradient reducer is built and train_step is refused."""
    constants_file: str | None = None
    """Values of the tensors the forward creates from literals (path relative to the generated file):
    always loaded, whatever `init_params` says, since they are part of the code, not the weights."""
    constant_users: Mapping[str, str] | None = None
    """Every constant some rank's code uses -> who uses it (e.g. "stage 1 (rank 1)"): the same on every
    rank, which checks the file holds them all and loads those it registers (nnscaler.runtime.module_parts.constants)."""
    check_input_agreement: bool = True
    """Before each forward / train_step of a plan over several ranks, check that they all got inputs of
    the same shapes and values (one all-gather of three int64; see nnscaler.runtime.dist.preflight). Set False
    to skip it."""
    check_input_values: bool = True
    """With check_input_agreement: compare a checksum of the inputs' values too (on CUDA it waits for the
    device once per call). Set False to compare shapes only."""
    plan_fingerprint: str | None = None
    """Identifies the plan this code was generated for (the compiler sets it, the same on every rank of
    one compile); checkpoints carry it so pieces of different plans are never merged together."""

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        plan_ngpus: int,
        groups: Mapping[str, Sequence[int]],
        all_groups: Sequence[Sequence[int]],
    ) -> None:
        super().__init__()
        if plan_ngpus < 1 or world_size % plan_ngpus != 0 or not 0 <= rank < world_size:
            raise ValueError(f"bad layout: rank={rank}, world_size={world_size}, plan_ngpus={plan_ngpus}")
        if is_initialized():
            if (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
                raise RuntimeError(
                    f"{type(self).__name__} was generated for rank {rank} of {world_size} but this process "
                    f"is rank {dist.get_rank()} of {dist.get_world_size()}"
                )
        self.rank = rank
        self.world_size = world_size
        self.plan_ngpus = plan_ngpus
        self._group_ranks = {name: sorted(int(r) for r in ranks) for name, ranks in groups.items()}
        self.fullmap: dict[str, ShardInfo] = {}
        self.aliases: dict[str, str] = {}
        self._local_of: dict[str, str] = {}
        self._grads_synced = False
        self._norm_owned: list[bool] | None = None
        self._reducer: Reducer | None = None
        self._reducer_built = False
        self._zero3: Zero3Reducer | None = None
        """ZeRO stage 3 (the reducer, once built): hands out gathered parameters, see `__getattr__`."""
        self._tied: dict[str, list[int]] = {}  # see EndToEndMixin.add_tied
        self.dims = ParallelDims(plan_ngpus, world_size)
        create_groups([*all_groups, *self.dims.plan_groups(), *self.dims.dp_groups()])
        lifecycle.track(self)
        if plan_ngpus > 1:  # the per-call input-shape check runs over the plan's ranks on the host
            create_host_groups(self.dims.plan_groups())
        self._in_step = False  # inside train_step / infer_step: forward skips the checks made there
        self.register_forward_pre_hook(_before_forward, with_kwargs=True)
        self.register_forward_hook(_after_forward, always_call=True)
        config = type(self).compute_config  # torch_compile: forward / stage{k} compiled on their first call
        compile_generated(self, config.torch_compile if config is not None else False)

    # ---- groups -------------------------------------------------------------------------------------

    def _plan_ranks(self) -> list[int]:
        return self.dims.plan_group(self.rank)

    def _dp_ranks(self) -> list[int]:
        return self.dims.dp_group(self.rank)

    def _preflight(self, what: str, named_inputs: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        """Before running: refuse without the process group; the ranks of the plan got the same inputs."""
        owner = type(self).__name__
        self._require_buffers_inited(what)  # non-persistent buffers never written: refuse (buffers_init)
        preflight.require_process_group(owner, what, self.rank, self.world_size, self.plan_ngpus)
        if self.plan_ngpus > 1 and self.check_input_agreement:
            preflight.check_plan_inputs(
                owner,
                what,
                named_inputs(),
                get_host_group(self._plan_ranks()),
                rank=self.rank,
                plan_ngpus=self.plan_ngpus,
                world_size=self.world_size,
                values=self.check_input_values,
            )

    def check_input_structure(self, spec: Any, expected: Any) -> None:
        """Generated code calls this: forward inputs must be nested as they were when traced."""
        if spec != expected:
            raise TypeError(
                f"{type(self).__name__}.forward got inputs structured as {spec}, but the code was generated "
                f"for {expected}: call it with the same nesting as the dummy inputs given to parallelize"
            )

    def check_untraced_args(self, given: dict[str, Any], defaults: dict[str, Any]) -> None:
        """Generated code calls this: arguments not given when tracing must keep their defaults."""
        for name, value in given.items():
            if value is defaults[name]:
                continue
            if isinstance(value, torch.Tensor) or value != defaults[name]:
                shown = (
                    f"<tensor of shape {list(value.shape)}>"
                    if isinstance(value, torch.Tensor)
                    else repr(value)
                )
                raise ValueError(
                    f"{type(self).__name__}.forward: {name}={shown} was not part of the dummy inputs when the "
                    f"code was generated (it used the default {defaults[name]!r}); add it to dummy_forward_args "
                    "and parallelize again"
                )

    def input_sizes(self, name: str, value: Any, expected: tuple, static: bool | tuple = False) -> tuple:
        """Generated code calls this first: input `name`'s sizes, checked against the traced ones."""
        return shapes.input_sizes(type(self).__name__, name, value, expected, static)

    def check_shape(self, holds: bool, rule: str, why: str, inputs: dict[str, Any]) -> None:
        """Generated code calls this: a condition on input sizes the plan or the trace needs."""
        shapes.check_shape(type(self).__name__, holds, rule, why, inputs)

    def check_constant_input(self, index: int, value: Any, traced: Any) -> None:
        """Generated code calls this: a non-tensor input was baked into the code when traced."""
        if value != traced:
            raise ValueError(
                f"{type(self).__name__}.forward: non-tensor input #{index} is {value!r} but the code was "
                f"generated with {traced!r}; pass the same value or parallelize again with this one"
            )

    def group(self, name: str) -> dist.ProcessGroup | None:
        """The process group named in the generated code ("dp" and "plan" always exist); None if trivial."""
        if name in self._group_ranks:
            return get_group(self._group_ranks[name])
        if name == "dp":
            return get_group(self._dp_ranks())
        if name == "plan":
            return get_group(self._plan_ranks())
        if name == "pp":  # no pipeline: this rank alone
            return None
        raise KeyError(f"{type(self).__name__} has no group {name!r}; known: {sorted(self._group_ranks)}")

    @property
    def device(self) -> torch.device:
        """Where this module's tensors live (generated code creates new tensors here)."""
        for t in self.parameters():
            return t.device
        for t in self.buffers():
            return t.device
        return runtime_device()

    # ---- registration -------------------------------------------------------------------------------

    def add_shard(
        self,
        local_name: str,
        original_name: str,
        full_shape: Sequence[int],
        dtype: torch.dtype,
        shard: Sequence[int] | None = None,
        *,
        is_param: bool = True,
        persistent: bool = True,
        requires_grad: bool = True,
    ) -> None:
        """Register this rank's piece of `original_name` (an empty tensor until `load_shards`).

        `requires_grad=False`: a frozen parameter (the user's `requires_grad` when traced). It gets no
        gradient, no reducer bucket and no optimizer state, and is saved and loaded like any other."""
        if local_name in self.fullmap or original_name in self._local_of or original_name in self.aliases:
            raise ValueError(f"add_shard: {local_name!r} / {original_name!r} registered twice")
        if is_param and not persistent:
            raise ValueError(f"add_shard: parameter {original_name!r} cannot be non-persistent")
        full = tuple(int(s) for s in full_shape)
        info = ShardInfo(
            local_name, original_name, full, dtype, normalize_shard(shard, len(full)), is_param, persistent
        )
        empty = torch.empty(info.local_shape, dtype=dtype, device="meta")
        if is_param:
            trainable = requires_grad and dtype.is_floating_point and not self.inference_only
            self.register_parameter(local_name, nn.Parameter(empty, requires_grad=trainable))
        else:
            self.register_buffer(local_name, empty, persistent=persistent)
        self.fullmap[local_name] = info
        self._local_of[original_name] = local_name
        self._norm_owned = None

    def add_alias(self, alias_name: str, original_name: str) -> None:
        """Record a second state-dict name (a tied weight) for an already registered tensor."""
        if original_name not in self._local_of:
            raise KeyError(f"add_alias: {original_name!r} is not registered (call add_shard first)")
        if alias_name in self._local_of or alias_name in self.aliases:
            raise ValueError(f"add_alias: {alias_name!r} is already a registered name")
        self.aliases[alias_name] = original_name

    def __getattr__(self, name: str) -> Any:
        zero3 = self.__dict__.get("_zero3")
        if zero3 is not None:  # ZeRO-3: generated code reads the gathered parameter
            value = zero3.fetch(name)
            if value is not None:
                return value
        return super().__getattr__(name)

    def _tensor(self, local_name: str) -> torch.Tensor:
        """The registered tensor (under ZeRO-3 a parameter holds no data; see `_write`, `state_dict`)."""
        found = self._parameters.get(local_name)
        return found if found is not None else self._buffers[local_name]

    def _write(self, local_name: str, value: torch.Tensor) -> None:
        if self._zero3 is not None and local_name in self._zero3:
            self._zero3.write(local_name, value)
        else:
            self._tensor(local_name).copy_(value)
        self._buffer_written(local_name)

    def _init_source(self) -> Mapping[str, torch.Tensor] | None:
        cls = type(self)
        if cls.init_state_dict is not None:
            return cls.init_state_dict
        if cls.init_weights_file is None:
            return None
        return cls._load_relative(cls.init_weights_file)

    @classmethod
    def _load_relative(cls, path: str | None) -> Mapping[str, torch.Tensor] | None:
        """torch.load a file named relative to the generated file (None: no file)."""
        module_file = getattr(sys.modules.get(cls.__module__), "__file__", None)
        if path is not None and not os.path.isabs(path) and module_file:
            path = os.path.join(os.path.dirname(module_file), path)
        fix = "generate the code again (reuse='override')"
        return None if path is None else load_file(path, weights_only=True, mmap=True, fix=fix)

    def load_shards(self, init_params: bool = True) -> None:
        """Allocate local tensors on `runtime_device()`; fill them from the full weights if a source is set."""
        self._drop_reducer()
        device = runtime_device()
        for name, info in self.fullmap.items():
            data = torch.empty(info.local_shape, dtype=info.dtype, device=device)
            if info.is_param:
                self._parameters[name] = nn.Parameter(
                    data, requires_grad=self._parameters[name].requires_grad
                )
            else:
                self._buffers[name] = data
        self._reset_buffers_init()  # writes below (_write) mark the non-persistent buffers they fill
        constants = load_constants(self)  # part of the code: loaded whatever init_params says
        source = self._init_source() if init_params else None
        if source is not None:
            missing = [
                i.original_name
                for i in self.fullmap.values()
                if i.original_name not in constants and self._source_key(source, i) is None
            ]
            if missing:
                raise KeyError(f"{type(self).__name__}: the initial weights lack {missing}")
            self.load_merged_state_dict(source, strict=False)
        if init_params:  # init_params=False: the caller loads them (parallelize warns after)
            self._warn_uninit_buffers()

    # ---- full (merged) state dicts --------------------------------------------------------------------

    def _names_of(self, info: ShardInfo) -> list[str]:
        return [info.original_name] + [a for a, o in self.aliases.items() if o == info.original_name]

    def _source_key(self, state_dict: Mapping[str, Any], info: ShardInfo, prefix: str = "") -> str | None:
        return next((prefix + n for n in self._names_of(info) if prefix + n in state_dict), None)

    def load_merged_state_dict(
        self, state_dict: Mapping[str, torch.Tensor], strict: bool = True
    ) -> tuple[list[str], list[str]]:
        """Copy this rank's shard of every tensor from a full single-device state dict (original names).

        Either name of a tied weight is accepted. Non-persistent buffers are loaded when present and
        never reported missing. Returns `(missing_keys, unexpected_keys)`; `strict` raises on either.
        """
        missing: list[str] = []
        with torch.no_grad():
            for name, info in self.fullmap.items():
                key = self._source_key(state_dict, info)
                if key is None:
                    if info.persistent:
                        missing.append(info.original_name)
                    continue
                full = state_dict[key]
                if tuple(full.shape) != info.full_shape:
                    raise ValueError(f"{key}: full shape {tuple(full.shape)} != expected {info.full_shape}")
                self._write(name, shard_slice(full, info.shard))
        known = set(self._local_of) | set(self.aliases)
        unexpected = [k for k in state_dict if k not in known]
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"load_merged_state_dict into {type(self).__name__}: missing keys {missing}, "
                f"unexpected keys {unexpected}"
            )
        if unexpected and len(unexpected) == len(state_dict):  # nothing loaded: surely the wrong dict
            raise RuntimeError(
                f"load_merged_state_dict into {type(self).__name__}: none of the keys matches (e.g. "
                f"{unexpected[0]!r}; the module's names are like {next(iter(known), None)!r}); strip or add "
                "the prefix that differs"
            )
        return missing, unexpected

    # ---- per-rank state dicts ---------------------------------------------------------------------------

    @property
    def dist_param_map(self) -> dict[str, str]:
        """Local attribute name -> original state-dict name, for every registered tensor."""
        return {name: info.original_name for name, info in self.fullmap.items()}

    @property
    def plan_id(self) -> str:
        """`plan_fingerprint`, or (hand-written modules) a hash of the class name and the device layout."""
        if self.plan_fingerprint:
            return self.plan_fingerprint
        layout = repr((type(self).__qualname__, self.world_size, self.plan_ngpus)).encode()
        return "layout-" + hashlib.sha256(layout).hexdigest()[:16]

    def get_extra_state(self) -> dict[str, Any]:
        return {
            "format": EXTRA_STATE_FORMAT,
            "rank": self.rank,
            "plan": self.plan_id,
            "world_size": self.world_size,
            "plan_ngpus": self.plan_ngpus,
            "fullmap": {i.original_name: i.to_meta() for i in self.fullmap.values()},
            "aliases": dict(self.aliases),
        }

    def set_extra_state(self, state: Any) -> None:
        mine = self.get_extra_state()
        if not isinstance(state, dict) or state.get("format") != EXTRA_STATE_FORMAT:
            raise ValueError(f"{type(self).__name__}: the extra state is not a ParallelModule's")
        fields = ("rank", "world_size", "plan_ngpus", "fullmap", "aliases")
        if any(state.get(f) != mine[f] for f in fields) or state.get("plan", mine["plan"]) != mine["plan"]:
            raise ValueError(
                f"{type(self).__name__}: this state dict was saved by rank {state.get('rank')} of a different "
                "plan or rank; merge the ranks' state dicts with merge_state_dicts and load the result with "
                "load_merged_state_dict"
            )

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        gathered = self._zero3.full_tensors() if self._zero3 is not None else {}  # collective
        for name, info in self.fullmap.items():
            if info.persistent:
                tensor = gathered[name] if name in gathered else self._tensor(name)
                destination[prefix + info.original_name] = tensor if keep_vars else tensor.detach()
        destination[prefix + EXTRA_STATE_KEY] = self.get_extra_state()

    def _load_from_state_dict(
        self,
        state_dict: Mapping[str, Any],
        prefix: str,
        local_metadata: Any,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        extra_key = prefix + EXTRA_STATE_KEY
        if extra_key in state_dict:
            try:
                self.set_extra_state(state_dict[extra_key])
            except ValueError as err:
                error_msgs.append(str(err))
                return
        elif strict:
            missing_keys.append(extra_key)
        with torch.no_grad():
            for name, info in self.fullmap.items():
                if not info.persistent:
                    continue
                key = self._source_key(state_dict, info, prefix)
                if key is None:
                    if strict:
                        missing_keys.append(prefix + info.original_name)
                    continue
                value, tensor = state_dict[key], self._tensor(name)
                if tuple(value.shape) != tuple(tensor.shape):
                    error_msgs.append(
                        f"size mismatch for {key}: copying a tensor of shape {tuple(value.shape)}, "
                        f"the local shard has shape {tuple(tensor.shape)}"
                    )
                    continue
                self._write(name, value)
        if strict:
            known = set(self._local_of) | set(self.aliases) | {EXTRA_STATE_KEY}
            unexpected_keys.extend(
                k for k in state_dict if k.startswith(prefix) and k[len(prefix) :] not in known
            )
