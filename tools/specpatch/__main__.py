import sys

from specpatch.cli import main

sys.exit(main())
