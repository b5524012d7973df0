"""The ``kvferry`` command line, the top layer: ``main`` builds the parser from the command modules."""

from kvferry.cli.main import main

__all__ = ["main"]
