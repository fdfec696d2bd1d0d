"""moebal.commands."""
