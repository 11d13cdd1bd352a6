"""The package version, importable from every layer (it imports nothing)."""

__version__ = "0.1.0"
