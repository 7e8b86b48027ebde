"""nnscaler as a Lightning Fabric strategy: `L.Fabric(strategy=NnScalerFabricStrategy(compute_config=...,
pas_policy='tp', dummy_forward_args=...))`. See docs/lightning.md."""

from nnscaler.integration.lightning.fabric.strategy import NnScalerFabricStrategy

__all__ = ["NnScalerFabricStrategy"]
