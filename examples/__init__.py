"""Example models and training scripts (importable so tests can use the models)."""
