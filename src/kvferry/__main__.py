"""``python -m kvferry``: the same entry point as the ``kvferry`` script."""

from kvferry.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
