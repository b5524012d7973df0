"""Rewrite docs/protocol.md's state tables from the code (kvferry.control.core.states), in place.

Run after changing a transition table: ``PYTHONPATH=src python scripts/protocol_tables.py``.
tests/test_control_core.py fails while the page and the code differ.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from kvferry.control.core.states import LINK_TRANSITIONS, SESSION_TRANSITIONS, TRANSITIONS, render_table

DOC = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"
TABLES = {"request": TRANSITIONS, "session": SESSION_TRANSITIONS, "link": LINK_TRANSITIONS}
SECTION = re.compile(r"(<!-- table:(\w+) -->\n).*?(<!-- /table -->)", re.S)


def render(text: str) -> str:
    """``text`` with every marked table replaced by the code's."""
    return SECTION.sub(lambda m: m.group(1) + render_table(TABLES[m.group(2)]) + "\n" + m.group(3), text)


def main() -> int:
    text = DOC.read_text()
    new = render(text)
    if new != text:
        DOC.write_text(new)
        print(f"rewrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
