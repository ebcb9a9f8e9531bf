"""``python -m hyperrng`` runs the command line."""

import sys

from hyperrng.cli import main

sys.exit(main())
