"""Print the configuration reference as a Markdown table (pasted into README.md).

    python tools/config_reference.py
"""

from visppo.config import field_docs


def reference() -> str:
    """The Markdown tables, one per section; README.md holds this text verbatim."""
    lines, section = [], None
    for key, (typ, default, doc) in field_docs().items():
        head = key.split(".")[0]
        if head != section:
            section = head
            lines += ["", f"**{section}**", "", "| key | type | default | what it does |", "| --- | --- | --- | --- |"]
        shown = repr(default) if isinstance(default, str) else default
        lines.append(f"| `{key}` | {typ.replace(' | ', ' or ')} | `{shown}` | {doc.replace('|', '/')} |")
    return "\n".join(lines[1:]) + "\n"


if __name__ == "__main__":
    print(reference(), end="")
