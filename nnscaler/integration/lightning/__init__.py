"""Lightning integration: `nnscaler.integration.lightning.pytorch` (needs `pip install nnscaler[lightning]`)."""
