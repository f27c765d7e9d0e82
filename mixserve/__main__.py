"""`python -m mixserve ...` is the same as the `mixserve` command."""

import sys

from mixserve.cli import main

sys.exit(main())
