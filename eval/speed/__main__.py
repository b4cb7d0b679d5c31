"""``python -m eval.speed [flags]``."""

import sys

from eval.speed.cli import main

sys.exit(main())
