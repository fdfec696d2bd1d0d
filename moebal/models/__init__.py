"""moebal.models."""
