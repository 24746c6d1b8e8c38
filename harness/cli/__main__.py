"""``python -m harness.cli``: the ``gym-resilience`` command."""

import sys

from harness.cli.main import main

sys.exit(main())
