"""moebal: train Mixture-of-Experts and dynamic transformers with per-iteration load balancing."""

__version__ = "0.1.0"

from moebal.models.moe import MoELayer

__all__ = ["MoELayer", "__version__"]
