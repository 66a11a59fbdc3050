"""Keeps the stabilizer tables of README.md and docs/methods.md equal to the registry.

    python -m stability.docs          # rewrite both tables from the registered stabilizers

Each table sits between a ``<!-- methods table ... -->`` line and ``<!-- end of methods table -->``.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from .stabilizers import methods_table

ROOT = Path(__file__).resolve().parent.parent
TABLES = {"README.md": "", "docs/methods.md": "../"}  # file → link prefix from that file to the repository root
PATTERN = re.compile(r"(<!-- methods table[^\n]*-->\n)(.*?)(<!-- end of methods table -->)", re.S)


def synced(text: str, link_prefix: str) -> str:
    """``text`` with its methods table replaced by the registry's; an error if it has none."""
    if not PATTERN.search(text):
        raise ValueError("no '<!-- methods table -->' … '<!-- end of methods table -->' block found")
    return PATTERN.sub(lambda m: m.group(1) + methods_table(link_prefix) + "\n" + m.group(3), text)


def main() -> int:
    for name, prefix in TABLES.items():
        path = ROOT / name
        path.write_text(synced(path.read_text(), prefix))
        print(f"wrote the methods table of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
