"""`python -m posttrain` runs the same command line as `posttrain`."""

import sys

from posttrain.cli import main

sys.exit(main())
