"""When two tensors are "the same" for `verify`: a tolerance relative to the reference's magnitude.

Both runs call the same kernels in the same order, so on one device they usually agree to the last
bit; the tolerance only absorbs reordered sums (gradients of a weight used twice, a reduction split
differently). Element-wise, |got - want| <= atol + rtol * |want|, where atol = atol_scale * max|want|
(a tensor of values around 1e3 may be off by 1e-2 in its small elements, one around 1e-3 by 1e-8).
For float32: rtol = 1e-4, atol_scale = 1e-5; looser for 16-bit floats. Integer and bool tensors
must be equal. NaN and infinity must sit at the same places.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Difference", "difference", "tolerances"]

_TOLERANCES = {
    torch.float16: (1e-2, 1e-3),
    torch.bfloat16: (4e-2, 1e-2),
}
_DEFAULT = (1e-4, 1e-5)


def tolerances(dtype: torch.dtype) -> tuple[float, float]:
    """(rtol, atol_scale) for tensors of `dtype`."""
    return _TOLERANCES.get(dtype, _DEFAULT)


@dataclass(frozen=True)
class Difference:
    """How `got` differs from `want`: the largest element-wise error and the tolerance it broke."""

    what: str
    max_abs: float = 0.0
    tolerance: float = 0.0

    def __str__(self) -> str:
        if self.tolerance or self.max_abs:
            return f"{self.what}: max abs difference {self.max_abs:.3g} where {self.tolerance:.3g} is allowed"
        return self.what


def _shape(t: torch.Tensor) -> str:
    return f"[{', '.join(str(s) for s in t.shape)}]"


def difference(got: object, want: object, floor: float = 0.0) -> Difference | None:
    """None when `got` matches `want` (tensors within tolerance, other values equal). `floor`: a least
    magnitude for the absolute tolerance (a gradient that is round-off only, e.g. of an attention key
    bias, which softmax ignores, is compared at the scale of the model's gradients)."""
    if not isinstance(want, torch.Tensor) or not isinstance(got, torch.Tensor):
        if isinstance(want, torch.Tensor) or isinstance(got, torch.Tensor):
            return Difference(f"{type(got).__name__} where eager has {type(want).__name__}")
        return None if got == want else Difference(f"{got!r} where eager has {want!r}")
    if got.shape != want.shape:
        return Difference(f"shape {_shape(got)} where eager has {_shape(want)}")
    if got.dtype != want.dtype:
        return Difference(f"dtype {got.dtype} where eager has {want.dtype}")
    got, want = got.detach(), want.detach().to(got.device)
    if not want.is_floating_point() and not want.is_complex():
        if torch.equal(got, want):
            return None
        return Difference(f"{int((got != want).sum())} of {want.numel()} elements differ")
    if torch.equal(got, want):  # the usual case: the same kernels in the same order
        return None
    rtol, atol_scale = tolerances(want.dtype)
    wide = want.dtype if want.dtype == torch.float64 or want.is_complex() else torch.float32
    a, b = got.to(wide), want.to(wide)
    err = (a - b).abs()
    if not bool(err.isfinite().all()):  # NaN or infinity somewhere: they must sit at the same places
        if not torch.equal(a.isnan(), b.isnan()):
            return Difference(
                f"NaN at {int((a.isnan() != b.isnan()).sum())} places where the other run has none"
            )
        finite = b.isfinite()
        if not torch.equal(a.isfinite(), finite) or not torch.equal(a[b.isinf()], b[b.isinf()]):
            return Difference("infinities at other places than in eager")
        a, b = a[finite], b[finite]
        err = (a - b).abs()
    if b.numel() == 0:
        return None
    magnitude = b.abs()
    scale = max(float(magnitude.max()), floor)
    if bool((err <= atol_scale * scale + rtol * magnitude).all()):
        return None
    return Difference(f"shape {_shape(got)}", float(err.max()), atol_scale * scale + rtol * scale)
