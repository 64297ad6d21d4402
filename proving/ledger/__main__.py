"""`python -m proving.ledger`."""

import sys

from proving.ledger.command import main

sys.exit(main())
