"""moebal.sim."""
