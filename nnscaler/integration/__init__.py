"""Integrations of nnscaler with training frameworks (Lightning: `nnscaler.integration.lightning`)."""
