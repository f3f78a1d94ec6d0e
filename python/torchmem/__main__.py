"""`python -m torchmem ...` runs the same command line as the `torchmem` script."""

import sys

from ._native import cli_main

sys.exit(cli_main())
