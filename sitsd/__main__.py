"""`python -m sitsd ...`: the same as the `sitsd` command."""

import sys

from sitsd.cli import main

sys.exit(main())
