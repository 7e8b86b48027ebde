"""Integrations of nnscaler with training frameworks (Lightning: `nnscaler.integration.lightning`) and
with Hugging Face checkpoints (`nnscaler.integration.hf`: load_pretrained / save_pretrained)."""
