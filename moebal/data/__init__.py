"""moebal.data."""
