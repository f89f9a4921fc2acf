"""`python -m tandem.cli ...` is the `tandem` command (children of `tandem up` are started this way)."""

import sys

from tandem.cli.main import main

sys.exit(main())
