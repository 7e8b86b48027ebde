"""Lightning integration (needs `pip install nnscaler[lightning]`): `nnscaler.integration.lightning.pytorch`
(the Trainer's NnScalerStrategy) and `nnscaler.integration.lightning.fabric` (NnScalerFabricStrategy)."""
