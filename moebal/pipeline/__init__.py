"""moebal.pipeline."""
