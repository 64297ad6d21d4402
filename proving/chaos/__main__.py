import sys

from proving.chaos.command import main

sys.exit(main())
