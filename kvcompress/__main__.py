"""``python -m kvcompress`` = the ``kvcompress`` command."""

import sys

from kvcompress.cli import main

sys.exit(main())
