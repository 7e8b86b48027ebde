"""nnScaler 0.8's `nnscaler.graph.function` import paths (anchor, dimops) for its policy API."""
