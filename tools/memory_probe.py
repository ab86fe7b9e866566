"""The memory probe as a script: the same code and options as ``visppo probe``.

    python tools/memory_probe.py configs/dot_reach.yaml env.image_size=84 --budget 8GiB --plot probe.png
"""

from __future__ import annotations

import sys

from visppo.cli import main as visppo_main


def main(argv: list[str] | None = None) -> int:
    """``visppo probe ARGV`` (``sys.argv[1:]`` when None): its exit code; bad input is one
    ``error:`` line and exit code 2, as the CLI reports it."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        return visppo_main(["probe", *args])
    except SystemExit as exc:  # argparse's own errors exit
        return exc.code if isinstance(exc.code, int) else 2


if __name__ == "__main__":
    sys.exit(main())
