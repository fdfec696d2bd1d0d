"""moebal.train."""
