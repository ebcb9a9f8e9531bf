"""``python -m hyperrng.cli`` runs the command line, as ``python -m hyperrng`` and ``hyperrng`` do."""

import sys

from hyperrng.cli import main

sys.exit(main())
