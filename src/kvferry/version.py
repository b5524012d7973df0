"""kvferry's release, beside ``errors`` at the bottom so any layer may name it without importing the package."""

__version__ = "0.4.0.dev0"
