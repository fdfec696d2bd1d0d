"""moebal: train Mixture-of-Experts and dynamic transformers with per-iteration load balancing."""

from typing import Any

__version__ = "0.1.0"

__all__ = ["MoELayer", "__version__"]


def __getattr__(name: str) -> Any:
    # Imported on first use: planners and their background worker processes import moebal without torch.
    if name == "MoELayer":
        from moebal.models.moe import MoELayer

        return MoELayer
    raise AttributeError(f"module 'moebal' has no attribute {name!r}")
