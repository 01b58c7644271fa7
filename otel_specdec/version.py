"""The package version, used in the meter's instrumentation scope."""

__version__ = "0.1.0"
