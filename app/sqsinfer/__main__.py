import sys

from sqsinfer.cli import main

# Spawned children import this module as __mp_main__: only a real run starts the CLI.
if __name__ == "__main__":
    sys.exit(main())
