"""Lightning Fabric: not supported yet (nnScaler 0.8 ships this package empty too)."""
