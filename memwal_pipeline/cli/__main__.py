"""`python -m memwal_pipeline.cli`: the `memwal` command."""

import sys

from .main import main

sys.exit(main())
