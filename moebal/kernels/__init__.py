"""moebal.kernels."""
