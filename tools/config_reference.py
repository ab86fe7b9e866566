"""The configuration reference as Markdown tables, generated from visppo/config.py's docstrings.

    python tools/config_reference.py                                  # print the tables
    python tools/config_reference.py --write docs/configuration.md    # rewrite them in place
    python tools/config_reference.py --check docs/configuration.md    # exit 1 if out of date

``--write`` and ``--check`` touch only the text between the two marker comments
(:data:`START` and :data:`END`); the rest of the file is left as it is.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from visppo.atomic import atomic_write_text
from visppo.config import field_docs

START = "<!-- config-reference:start -->"
END = "<!-- config-reference:end -->"
DOC = "docs/configuration.md"
"""The file that holds the reference (relative to the repository root)."""
FIX = f"python tools/config_reference.py --write {DOC}"
"""The command that brings the file up to date."""


def reference() -> str:
    """The Markdown tables, one per section; :data:`DOC` holds this text verbatim."""
    lines, section = [], None
    for key, (typ, default, doc) in field_docs().items():
        head = key.split(".")[0]
        if head != section:
            section = head
            lines += ["", f"**{section}**", "", "| key | type | default | what it does |", "| --- | --- | --- | --- |"]
        shown = repr(default) if isinstance(default, str) else default
        lines.append(f"| `{key}` | {typ.replace(' | ', ' or ')} | `{shown}` | {doc.replace('|', '/')} |")
    return "\n".join(lines[1:]) + "\n"


def current_block(text: str) -> str | None:
    """The text between the markers in ``text`` (None when the markers are missing or out of order)."""
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        return None
    return text[start + len(START):end].removeprefix("\n")


def rewrite(text: str, table: str | None = None) -> str:
    """``text`` with the block between the markers replaced by ``table`` (default: :func:`reference`)."""
    table = reference() if table is None else table
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {START} ... {END} block to rewrite")
    return text[:start] + START + "\n" + table + text[end:]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", metavar="FILE", type=Path, help="rewrite the block between the markers in FILE")
    group.add_argument("--check", metavar="FILE", type=Path, help="exit 1 if FILE's block is not the generated text")
    args = parser.parse_args(argv)
    if args.write is None and args.check is None:
        sys.stdout.write(reference())
        return 0
    path = args.write or args.check
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:  # exit 1 means "out of date": a wrong path is not that
        print(f"error: cannot read {path}: {getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        return 2
    if current_block(text) is None:
        print(f"error: {path} has no {START} ... {END} block", file=sys.stderr)
        return 2
    new = rewrite(text)
    if args.check is not None:
        if new != text:
            print(f"{path} is out of date: run python tools/config_reference.py --write {path}", file=sys.stderr)
            return 1
        return 0
    if new != text:
        atomic_write_text(path, new)
        print(f"rewrote the configuration reference in {path}")
    else:
        print(f"{path} is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
