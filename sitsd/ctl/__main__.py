"""`python -m sitsd.ctl ...`: the same as the `sitsctl` command."""

import sys

from sitsd.ctl.main import main

sys.exit(main())
