"""The package version: one place, read by the package, by profiles (which record it) and by pyproject.toml."""

__version__ = "0.1.0"
