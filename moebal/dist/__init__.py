"""moebal.dist."""
