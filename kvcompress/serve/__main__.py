import sys

from kvcompress.serve.cli import main

sys.exit(main())
