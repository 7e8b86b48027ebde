"""An annotation for an opaque function found by running it: which output dims commute with slicing.

Used for custom autograd Functions the user gave no annotation (graph/capture/autograd_fn.py),
decided by what the forward does, never by its name. The function qualifies when its outputs all
have one shape S and each tensor input broadcasts to S (a bias, a per-feature scale). For each dim d
of S, on small random inputs: the forward on pieces of the inputs along d (the first element, the rest
of the first half, the second half; inputs that broadcast there passed whole), concatenated, must
equal the forward on the whole, and the backward (the Function's own, given random output gradients)
must give the pieces of the sliced inputs' gradients and, summed over the pieces, the broadcast
inputs' gradients; two random draws. Such a dim is plain in the annotation; any other is `^`.
Elementwise functions get every dim plain; row-wise ones (a norm, a softmax over the last dim) every
dim but the last. None when no dim passes, or the function cannot be probed (it raises on the probe's
inputs, takes values the probe cannot make): then it stays unannotated, kept whole with the usual
warning.

The pieces are views (not contiguous along the later dims); a function that raises on them keeps that
dim whole. Outputs of more than PROBE_NUMEL elements are probed with every dim shrunk to 8; a function
that raises on those is probed again with only its leading dims shrunk (to 4), then at its traced
sizes (up to 4M elements), then on the GPU if there is one. A backward that raises on the whole
inputs is not checked (it would fail alike whole or split). The user's random stream is left alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch

from nnscaler.graph.ir import Ref, TensorMeta
from nnscaler.graph.ops._letters import letters

__all__ = ["probe_annotation", "PROBE_NUMEL"]

PROBE_NUMEL = 1 << 12
"""Probe at the traced sizes up to this many output elements; above, at smaller ones (_probe_shapes)."""
_FULL_NUMEL = 1 << 22
"""A function that raises on the shrunk sizes is probed again at the traced ones up to this size."""
_DRAWS = 2
_TOL = {torch.float64: (1e-9, 1e-12), torch.float32: (1e-5, 1e-6)}
_LOOSE = (1e-2, 1e-3)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _probe_shapes(shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The sizes to probe at, each tried when the forward raises on the one before: the traced ones
    when small; else every dim at most 8, then the leading dims at most 4 (the last, often a feature
    size the function relies on, kept), then the traced ones unless too large."""
    if _numel(shape) <= PROBE_NUMEL:
        return [tuple(shape)]
    tries = [tuple(min(s, 8) for s in shape), tuple(min(s, 4) for s in shape[:-1]) + (shape[-1],)]
    if _numel(shape) <= _FULL_NUMEL:
        tries.append(tuple(shape))
    return list(dict.fromkeys(tries))


def _aligned(in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> list[int | None] | None:
    """For each input dim, the output dim it follows (None: broadcast, size 1); None if it does not
    broadcast to the output."""
    offset = len(out_shape) - len(in_shape)
    if offset < 0:
        return None
    out: list[int | None] = []
    for i, size in enumerate(in_shape):
        target = out_shape[i + offset]
        if size == target:
            out.append(i + offset)
        elif size == 1:
            out.append(None)
        else:
            return None
    return out


def _random(meta: TensorMeta, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    dtype = getattr(torch, meta.dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) < 0.5
    if dtype.is_complex:
        raise TypeError("complex inputs are not probed")
    return torch.randint(0, 3, shape, generator=gen, dtype=dtype)


def _fill(args: Any, tensors: list[torch.Tensor], it: list[int]) -> Any:
    """args with each Ref replaced by the next tensor."""
    if isinstance(args, Ref):
        it[0] += 1
        return tensors[it[0] - 1]
    if isinstance(args, (list, tuple)):
        return type(args)(_fill(a, tensors, it) for a in args)
    if isinstance(args, dict):
        return {k: _fill(v, tensors, it) for k, v in args.items()}
    if args is None or isinstance(args, (bool, int, float, str)):
        return args
    raise TypeError(f"argument {args!r} cannot be probed")


def _close(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if not (a.is_floating_point() or a.is_complex()):
        return torch.equal(a, b)
    rtol, atol = _TOL.get(a.dtype, _LOOSE)
    return torch.allclose(a, b, rtol=rtol, atol=atol, equal_nan=True)


class _Probe:
    def __init__(self, run: Callable[..., Any], args: tuple, metas: list[TensorMeta], out_shape: tuple):
        self.run, self.args, self.metas = run, args, metas
        self.out_shape = _probe_shapes(out_shape)[0]
        self.follow = [_aligned(m.shape, out_shape) for m in metas]
        self.device = torch.device("cpu")

    def inputs(self, gen: torch.Generator) -> list[torch.Tensor]:
        shapes = [tuple(1 if d is None else self.out_shape[d] for d in follow) for follow in self.follow]
        return [_random(m, s, gen).to(self.device) for m, s in zip(self.metas, shapes)]

    def variants(self, traced: tuple[int, ...]) -> Iterator[_Probe]:
        """This probe at each of `_probe_shapes`, then on the GPU if there is one: the next is tried
        when a forward raises on the whole inputs."""
        for shape in _probe_shapes(traced):
            self.out_shape = shape
            yield self
        if torch.cuda.is_available():
            self.device = torch.device("cuda")
            yield self

    def call(self, tensors: list[torch.Tensor], grads: list[torch.Tensor] | None):
        """(outputs, input gradients or None where backward cannot run)."""
        leaves = [t.detach().requires_grad_(t.is_floating_point()) for t in tensors]
        with torch.enable_grad():
            out = self.run(*_fill(self.args, leaves, [0]))
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        if grads is None:
            return [o.detach() for o in outs], None
        wanted = [t for t in leaves if t.requires_grad]
        pairs = [(o, g) for o, g in zip(outs, grads) if o.requires_grad]
        if not pairs or not wanted:
            return [o.detach() for o in outs], []
        try:
            got = torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
        except RuntimeError:
            return [o.detach() for o in outs], None
        by_leaf = iter(got)
        return [o.detach() for o in outs], [next(by_leaf) if t.requires_grad else None for t in leaves]

    def safe_commutes(self, dim: int, tensors: list[torch.Tensor], whole, grads) -> bool:
        """commutes(), False where the function raises on the pieces (it checks a size, say)."""
        try:
            return self.commutes(dim, tensors, whole, grads)
        except Exception:  # noqa: BLE001
            return False

    def commutes(self, dim: int, tensors: list[torch.Tensor], whole, grads) -> bool:
        """Does the function on pieces along `dim` (the first element, the rest of the first half, the
        second half) give the pieces of `whole`?"""
        outs, in_grads = whole
        size = self.out_shape[dim]
        cuts = sorted({1, size // 2}) + [size]  # an odd cut too: no function of the index's parity passes
        pieces = []
        for part in (slice(a, b) for a, b in zip([0] + cuts, cuts)):
            sliced = [self._slice(t, f, dim, part) for t, f in zip(tensors, self.follow)]
            g = None if in_grads is None else [x[(slice(None),) * dim + (part,)] for x in grads]
            pieces.append(self.call(sliced, g))
        for k, o in enumerate(outs):
            if not _close(torch.cat([p[0][k] for p in pieces], dim), o):
                return False
        if in_grads is None:
            return True
        if any(p[1] is None for p in pieces):
            return False
        for i, (full, follow) in enumerate(zip(in_grads, self.follow)):
            parts = [p[1][i] if p[1] else None for p in pieces]
            if full is None or any(x is None for x in parts):
                if not (full is None and all(x is None for x in parts)):
                    return False
                continue
            at = follow.index(dim) if dim in follow else None
            merged = torch.cat(parts, at) if at is not None else torch.stack(parts).sum(0)
            if not _close(merged, full):
                return False
        return True

    @staticmethod
    def _slice(t: torch.Tensor, follow: list[int | None], dim: int, part: slice) -> torch.Tensor:
        if dim not in follow:
            return t
        return t[(slice(None),) * follow.index(dim) + (part,)]


def probe_annotation(
    run: Callable[..., Any], args: tuple, metas: list[TensorMeta], out_metas: list[TensorMeta | None]
) -> str | None:
    """The annotation of `run(*args)` (args with Refs for the tensors, whose metas are `metas`, in
    order) found by probing; None when no dim can be split or it cannot be probed."""
    if not out_metas or any(m is None for m in out_metas):
        return None
    out_shape = tuple(out_metas[0].shape)
    if not out_shape or any(tuple(m.shape) != out_shape for m in out_metas):
        return None
    probe = _Probe(run, args, metas, out_shape)
    if any(f is None for f in probe.follow):
        return None
    dims = [d for d, size in enumerate(probe.out_shape) if size > 1]
    splittable = set(dims)
    gen = torch.Generator().manual_seed(0)
    for variant in probe.variants(out_shape):
        try:
            gpu = [torch.cuda.current_device()] if variant.device.type == "cuda" else []
            with torch.random.fork_rng(devices=gpu):  # a forward that draws leaves the user's stream alone
                passed = _passing(variant, splittable, len(out_metas), gen)
            break
        except Exception:  # noqa: BLE001  (a function the probe cannot run stays whole)
            passed = set()
    splittable = passed
    if not splittable:
        return None
    ids = [i + ("" if d in splittable else "^") for d, i in enumerate(letters(len(out_shape)))]
    ins = [" ".join("1" if d is None else ids[d] for d in follow) for follow in probe.follow]
    return ", ".join(ins) + " -> " + ", ".join(" ".join(ids) for _ in out_metas)


def _passing(probe: _Probe, splittable: set[int], n_out: int, gen: torch.Generator) -> set[int]:
    """The dims of `splittable` along which the function commutes with slicing, on every draw."""
    splittable = set(splittable)
    for _ in range(_DRAWS):
        tensors = probe.inputs(gen)
        outs, _ = probe.call(tensors, None)
        if len(outs) != n_out or any(tuple(o.shape) != probe.out_shape for o in outs):
            return set()
        grads = [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) for o in outs]
        whole = probe.call(tensors, grads if all(o.is_floating_point() for o in outs) else None)
        splittable = {d for d in splittable if probe.safe_commutes(d, tensors, whole, grads)}
        if not splittable:
            break
    return splittable
