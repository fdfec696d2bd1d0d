"""moebal.routing."""
