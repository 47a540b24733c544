"""The package version (a leaf module: the plugin's cache salt reads it)."""

__version__ = "0.1.0"
