"""`python -m continuum_operator.cli`: the `continuum` command."""

import sys

from continuum_operator.cli import main

sys.exit(main())
