"""moebal.scheduler."""
