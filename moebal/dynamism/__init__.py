"""Dynamism schemes: what makes per-layer cost drift while a model trains."""
