"""A stand-in for Tutel (github.com/microsoft/tutel) with the interface moebal's benchmarks use, for tests only:
Tutel installs from source and is not installed here. See moe.py."""

__version__ = "0.0.0+stand-in"
