"""`python -m ray_diloco.cli ...`, as `ray job submit` runs it."""

import sys

from ray_diloco.cli.commands import main

sys.exit(main())
