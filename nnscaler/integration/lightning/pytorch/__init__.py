"""nnscaler as a Lightning strategy: `L.Trainer(strategy=NnScalerStrategy(compute_config=...,
pas_policy='tp'), plugins=[NnScalerPrecision('bf16-mixed')])`. See docs/lightning.md."""

from nnscaler.integration.lightning.pytorch.precision import NnScalerPrecision
from nnscaler.integration.lightning.pytorch.strategy import NnScalerStrategy

__all__ = ["NnScalerStrategy", "NnScalerPrecision"]
