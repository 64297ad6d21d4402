"""`python -m proving.fleetsim`."""

import sys

from proving.fleetsim.command import main

sys.exit(main())
