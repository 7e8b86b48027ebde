"""nnScaler's import path of the mixed-precision optimizers (`nnscaler.runtime.f16_optimizer`)."""

from nnscaler.runtime.grads.mixed_precision import (
    MixedPrecisionAdam,
    MixedPrecisionAdamW,
    MixedPrecisionOptimizer,
)

MixedPrecisionF16OptimizerMixin = MixedPrecisionOptimizer
"""nnScaler's name of the mixin."""

__all__ = ["MixedPrecisionAdam", "MixedPrecisionAdamW", "MixedPrecisionF16OptimizerMixin"]
