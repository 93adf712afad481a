"""`python -m pipeline.cli`: `smpipe` without the console script."""

import sys

from pipeline.cli import main

sys.exit(main())
