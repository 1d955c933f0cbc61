"""`python -m bench COMMAND [args...]`: see bench/cli.py."""

import sys

from bench.cli import main

sys.exit(main())
