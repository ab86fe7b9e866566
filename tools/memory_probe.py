"""The memory probe as a script: the same code and options as ``visppo probe``.

    python tools/memory_probe.py configs/dot_reach.yaml env.image_size=84 --budget 8GiB --plot probe.png
"""

import sys

from visppo.cli import main

if __name__ == "__main__":
    sys.exit(main(["probe", *sys.argv[1:]]))
