import sys

from visppo.cli import main

sys.exit(main())
