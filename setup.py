"""The package's metadata is in pyproject.toml, its one source; ``setup()`` reads it there, so that tools that
still run ``setup.py`` build the same package."""
from setuptools import setup

setup()
